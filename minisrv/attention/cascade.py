"""Cascade (shared-prefix) decode: which requests of a decode step read the same prefix pages, and whether it pays.

Cascade attention splits each request's attention in two: its group's shared pages, read once for all the group's
queries, and its own remaining pages; the two results are merged exactly through their log-sum-exps (docs/kernels.md
says when it pays). This module only finds the groups, on the host; fi.py runs the two levels.

How groups are found, cheaply (O(batch * log(pages)) list lookups a step, no loop over pages): a page holds the KV
of its tokens computed with every token before them, and only the prefix cache hands one page to several requests,
always at the same page index. So two requests holding the same page at index j have the same tokens at every
position before the end of that page, and either one's pages up to j hold KV valid for both. Requests are bucketed
by the page they hold at index `min_pages - 1`; a bucket's shared length is then found by bisection on "every member
holds the first member's page at index n - 1", starting from the shortest member. Every page before index n then
holds the same tokens for every member, and the shared level reads the first member's pages for the whole group (a
member that computed an equal prefix itself, before it was cached, reads an equal copy: same tokens, same positions).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from minisrv.batch import PrefixGroups
from minisrv.utils import ceil_div

# A group needs this many requests: one request alone reads its prefix once anyway.
MIN_GROUP = 2
# ... sharing at least this many tokens: below it, the extra kernel and merge of the shared level cost more than
# the reads they save.
MIN_SHARED_TOKENS = 256
# A step runs as cascade only if it saves this many token reads of KV (summed over groups, (members - 1) x shared
# tokens): cascade steps run eagerly, and the reads saved must outweigh the CUDA graph's replay they give up
# (docs/kernels.md).
MIN_SAVED_TOKENS = 262144
# ... or this many when the step runs eagerly anyway (CUDA graphs off, or a batch larger than the largest graph):
# then the only cost is the shared level's kernel and the merge.
MIN_SAVED_TOKENS_EAGER = 32768


def find_prefix_groups(pages: Sequence[Sequence[int]], seq_lens: Sequence[int], page_size: int,
                       min_group: int = MIN_GROUP, min_shared_pages: int = 1,
                       min_saved_tokens: int = 0) -> Optional[PrefixGroups]:
    """Groups of a decode batch's requests that share at least `min_shared_pages` leading pages, or None when no
    group qualifies or together they save fewer than `min_saved_tokens` token reads.

    pages[i]: request i's pages in order of position; seq_lens[i]: its KV length after this step (the token written
    this step included). Only full pages before the one this step writes to can be shared: those the prefix cache
    hands out are whole pages of tokens already computed.
    """
    if min_group < 2 or min_shared_pages < 1:
        raise ValueError("a group needs at least 2 requests and 1 shared page")
    key_index = min_shared_pages - 1
    buckets: Dict[int, List[int]] = {}
    for i, (p, s) in enumerate(zip(pages, seq_lens)):
        if (s - 1) // page_size >= min_shared_pages:
            buckets.setdefault(p[key_index], []).append(i)
    members_of = [members for members in buckets.values() if len(members) >= min_group]
    shared = [_shared_length(pages, seq_lens, members, page_size, min_shared_pages) for members in members_of]
    if not members_of:
        return None
    order = [i for m in members_of for i in m]
    grouped = set(order)
    order += [i for i in range(len(pages)) if i not in grouped]
    groups = PrefixGroups(tuple(order), tuple(len(m) for m in members_of), tuple(shared))
    return groups if groups.saved_tokens(page_size) >= min_saved_tokens else None


def _shared_length(pages: Sequence[Sequence[int]], seq_lens: Sequence[int], members: List[int], page_size: int,
                   known: int) -> int:
    """The number of leading pages all members share: at least `known` (they hold the same page at index
    known - 1), at most the full pages before each member's current one; bisection on the page at index n - 1."""
    lead = pages[members[0]]

    def same(n: int) -> bool:
        return all(pages[i][n - 1] == lead[n - 1] for i in members)

    lo = known
    hi = min((seq_lens[i] - 1) // page_size for i in members)
    if same(hi):
        return hi
    # from here same(lo) holds and same(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if same(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class CascadePolicy:
    """When a decode step runs as cascade attention (see the thresholds above)."""

    page_size: int
    min_group: int = MIN_GROUP
    min_shared_tokens: int = MIN_SHARED_TOKENS
    min_saved_tokens: int = MIN_SAVED_TOKENS
    min_saved_tokens_eager: int = MIN_SAVED_TOKENS_EAGER

    def plan(self, pages: Sequence[Sequence[int]], seq_lens: Sequence[int],
             graph_replay: bool) -> Optional[PrefixGroups]:
        """The step's groups, or None to run it as plain decode. graph_replay: whether the step would otherwise
        replay a CUDA graph (which a cascade step gives up)."""
        return find_prefix_groups(pages, seq_lens, self.page_size, self.min_group,
                                  max(1, ceil_div(self.min_shared_tokens, self.page_size)),
                                  self.min_saved_tokens if graph_replay else self.min_saved_tokens_eager)
