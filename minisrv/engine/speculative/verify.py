"""The verify rule: which drafted tokens a request keeps.

A verify step samples each of a request's 1 + k positions (its last token, then each draft) as plain decoding would,
with every setting of the request (penalties over the output as if the earlier drafts were accepted) and, seeded,
the noise of that position's output index. The request keeps the drafts up to the first one the target did not
sample, then the target's own token at that position (or, all drafts kept, at the last one).

This is the rejection rule of Leviathan et al. (2023) and Chen et al. (2023) for a draft that proposes one token per
position (a point mass, as lookup drafts and greedy draft chains do): a draft d is kept with probability p(d) =
min(1, p(d) / q(d)) for q(d) = 1, and where it is not, the token is drawn from p without d, which is the residual
max(0, p - q) renormalised. So every output token is distributed exactly as the target's, and a seeded request
writes the very tokens it would write without speculation.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..request import Request
from ..step_results import SampledToken, token_logprob


class DraftPosition:
    """A request as the sampler sees it at its j-th verified position: its output as if its first j drafts were
    accepted (the fields SamplingBatch.build reads)."""

    __slots__ = ("params", "sampling_seed", "output_ids", "prompt_ids", "num_output_tokens", "grammar", "thinking")

    def __init__(self, req: Request, draft: Sequence[int], j: int) -> None:
        self.params = req.params
        self.sampling_seed = req.sampling_seed
        self.prompt_ids = req.prompt_ids
        self.output_ids = req.output_ids + list(draft[:j]) if j and req.params.has_penalties else req.output_ids
        self.num_output_tokens = len(req.output_ids) + j  # the index of the token sampled here
        self.grammar = None  # requests with a grammar or a thinking budget do not draft
        self.thinking = None

    @property
    def all_ids(self) -> List[int]:
        return self.prompt_ids + self.output_ids


def sampling_positions(reqs: Sequence[Request], drafts: Sequence[Sequence[int]]) -> List[DraftPosition]:
    """One sampling row per verified position, request by request: the step's token order."""
    return [DraftPosition(r, d, j) for r, d in zip(reqs, drafts) for j in range(len(d) + 1)]


def accepted_length(sampled: Sequence[int], draft: Sequence[int]) -> int:
    """How many drafts are kept: the longest prefix of `draft` equal to the target's samples at the same positions
    (`sampled` holds the target's token at each of the 1 + k positions)."""
    m = 0
    while m < len(draft) and sampled[m] == draft[m]:
        m += 1
    return m


def verified_tokens(reqs: Sequence[Request], drafts: Sequence[Sequence[int]], sampled: List[int],
                    lps: Optional[List[float]], top) -> Tuple[List[SampledToken], List[Tuple[Request, int, int]]]:
    """A verify step read back (`sampled`: the target's token at every position, request by request): for each
    request still running, its kept drafts and the target's token after them, in order, not yet appended (they join
    it one by one, up to where it ends: step_results.take_token); and (request, drafted, kept) for each."""
    tokens: List[SampledToken] = []
    verified = []
    row = 0
    for req, draft in zip(reqs, drafts):
        mine = sampled[row:row + len(draft) + 1]
        if not req.finished:
            kept = accepted_length(mine, draft)
            verified.append((req, len(draft), kept))
            tokens += [SampledToken(req, tok, token_logprob(req, tok, row + j, lps, top), appended=False)
                       for j, tok in enumerate(mine[:kept + 1])]
        row += len(draft) + 1
    return tokens, verified
