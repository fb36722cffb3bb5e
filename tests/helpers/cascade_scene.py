"""A decode batch whose requests share prefix pages the way the prefix cache hands them out, for the cascade
attention tests: on a CPU with the stand-in FlashInfer (tests/test_cascade.py) and on a GPU with the real one
(tests/gpu/test_cascade.py), so the GPU test's own set-up has already run once before it meets a GPU.

The pool's pages are handed out in a shuffled order and filled with random K/V; a shared prefix is a list of
whole pages that several requests hold at the start of their page lists, followed by pages of their own.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from minisrv.attention.cascade import find_prefix_groups
from minisrv.batch import ForwardBatch, ForwardMode, PrefixGroups
from minisrv.kvcache import KVPool, PageAllocator, slots_for
from minisrv.utils import ceil_div

NUM_LAYERS = 2
POOL_TOKENS = 8192
MAX_ROWS = 24
MAX_CONTEXT = 1024
MIN_SHARED_TOKENS = 256  # groups share at least this much in the standard case

# The standard case, in tokens (multiples of 16, so the same case runs at page sizes 1 and 16). Prefix name ->
# its length; each request: (prefix it starts with or None, tokens of its own before this step's token).
PREFIXES = {"A": 640, "B": 320, "C": 272, "A-head": 160}  # A-head: A's first 160 tokens (its first pages)
REQUESTS: List[Tuple[str, object, int]] = [
    # name, prefix, own tokens; in batch order, the groups interleaved. G shares only A's head, shorter than
    # MIN_SHARED_TOKENS: it joins no group; E and F share nothing.
    ("A0", "A", 0), ("E", None, 700), ("B0", "B", 3), ("A1", "A", 1), ("C0", "C", 5), ("F", None, 5),
    ("A2", "A", 15), ("B1", "B", 33), ("G", "A-head", 90), ("C1", "C", 250), ("A3", "A", 16), ("B2", "B", 64),
    ("A4", "A", 17), ("A5", "A", 100),
]
EXPECTED_GROUPS = {("A0", "A1", "A2", "A3", "A4", "A5"): 640, ("B0", "B1", "B2"): 320, ("C0", "C1"): 272}
# a batch already in cascade order: two groups, then a request in no group
IN_ORDER = ["A0", "A1", "B0", "B1", "F"]


class SharedPrefixScene:
    def __init__(self, page_size: int, dtype: torch.dtype, hkv: int, d: int, device: torch.device,
                 seed: int = 0, pool_tokens: int = POOL_TOKENS, max_rows: int = MAX_ROWS,
                 max_context: int = MAX_CONTEXT) -> None:
        self.page_size = page_size
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)
        num_pages = pool_tokens // page_size
        self.pool = KVPool(NUM_LAYERS, num_pages, page_size, hkv, d, dtype, device)
        fill = torch.Generator(device=device).manual_seed(seed)
        for layer in range(NUM_LAYERS):
            self.pool.kv[layer].normal_(generator=fill)
        self.table = torch.zeros((max_rows, max_context), dtype=torch.int32, device=device)
        self.alloc = PageAllocator(num_pages)
        everything = self.alloc.alloc(num_pages)
        perm = torch.randperm(num_pages, generator=self.gen).tolist()
        self.alloc.free([everything[i] for i in perm])  # the free stack now hands pages out in random order
        self.prefixes: Dict[str, List[int]] = {}
        self.rows: Dict[str, int] = {}
        self.pages: Dict[str, List[int]] = {}
        self.cached: Dict[str, int] = {}  # tokens in the pool before this step

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, self.pool.dtype)

    def add_prefix(self, name: str, tokens: int) -> None:
        assert tokens % self.page_size == 0
        self.prefixes[name] = self.alloc.alloc(tokens // self.page_size)

    def add_request(self, name: str, prefix: List[int], own: int) -> None:
        """A request holding `prefix` (whole pages) and `own` more tokens, plus room for this step's token."""
        ps = self.page_size
        cached = len(prefix) * ps + own
        pages = list(prefix) + self.alloc.alloc(ceil_div(cached + 1, ps) - len(prefix))
        row = len(self.rows)
        self.rows[name], self.pages[name], self.cached[name] = row, pages, cached
        self.table[row, :cached + 1] = slots_for(pages, ps, 0, cached + 1).to(torch.int32).to(self.device)

    def decode_batch(self, names: Sequence[str], groups: PrefixGroups = None) -> ForwardBatch:
        """One decode step of the named requests: each writes its next token at position `cached`."""
        ps = self.page_size
        cached = [self.cached[n] for n in names]
        seq = [c + 1 for c in cached]
        loc = [self.pages[n][c // ps] * ps + c % ps for n, c in zip(names, cached)]
        b = len(names)
        i64 = dict(dtype=torch.int64, device=self.device)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.zeros(b, **i64),
            positions=torch.tensor(cached, **i64),
            out_cache_loc=torch.tensor(loc, **i64),
            req_rows=torch.tensor([self.rows[n] for n in names], **i64),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device=self.device),
            logit_rows=torch.arange(b, **i64),
            seq_lens_cpu=seq,
            extend_lens_cpu=[1] * b,
            max_seq_len=max(seq),
            prefix_groups=groups,
        )

    def groups(self, names: Sequence[str], min_shared_tokens: int = MIN_SHARED_TOKENS) -> PrefixGroups:
        """The cascade plan for a decode step of `names` (every qualifying group, whatever it saves)."""
        plan = find_prefix_groups([self.pages[n] for n in names], [self.cached[n] + 1 for n in names],
                                  self.page_size, 2, ceil_div(min_shared_tokens, self.page_size), 0)
        assert plan is not None
        return plan

    def clone_pool(self) -> KVPool:
        p = self.pool
        twin = KVPool(p.num_layers, p.num_pages, p.page_size, p.num_kv_heads, p.head_dim, p.dtype, p.device)
        for layer in range(p.num_layers):
            twin.kv[layer].copy_(p.kv[layer])
        return twin


def standard_scene(page_size: int, dtype: torch.dtype, hkv: int, d: int, device: torch.device,
                   seed: int = 0) -> SharedPrefixScene:
    sc = SharedPrefixScene(page_size, dtype, hkv, d, device, seed)
    for name in ("A", "B", "C"):
        sc.add_prefix(name, PREFIXES[name])
    sc.prefixes["A-head"] = sc.prefixes["A"][:PREFIXES["A-head"] // page_size]
    for name, prefix, own in REQUESTS:
        sc.add_request(name, sc.prefixes[prefix] if prefix else [], own)
    return sc


def many_groups_scene(page_size: int, dtype: torch.dtype, hkv: int, d: int, device: torch.device,
                      num_prefixes: int, per_prefix: int, prefix_tokens: int, seed: int = 0
                      ) -> Tuple[SharedPrefixScene, List[str]]:
    """The offline benchmark's `prefix` workload mid-decode: num_prefixes prefixes of prefix_tokens, per_prefix
    requests on each with 16-256 prompt tokens and 0-512 generated ones of their own, shuffled. Returns the scene
    and the batch's request names."""
    rng = torch.Generator().manual_seed(seed)
    own = torch.randint(16, 256 + 512, (num_prefixes * per_prefix,), generator=rng).tolist()
    context = prefix_tokens + 256 + 512 + 1
    pages = num_prefixes * prefix_tokens // page_size + sum(ceil_div(o + 1, page_size) + 1 for o in own)
    sc = SharedPrefixScene(page_size, dtype, hkv, d, device, seed, pool_tokens=pages * page_size,
                           max_rows=len(own), max_context=ceil_div(context, page_size) * page_size)
    names = []
    for p in range(num_prefixes):
        sc.add_prefix(f"P{p}", prefix_tokens)
        for r in range(per_prefix):
            name = f"P{p}-{r}"
            sc.add_request(name, sc.prefixes[f"P{p}"], own[p * per_prefix + r])
            names.append(name)
    perm = torch.randperm(len(names), generator=rng).tolist()
    return sc, [names[i] for i in perm]


def named_groups(plan: PrefixGroups, names: Sequence[str], page_size: int) -> Dict[Tuple[str, ...], int]:
    """The plan's groups as {member names (in batch order): shared tokens}."""
    out, start = {}, 0
    for size, pages in zip(plan.sizes, plan.shared_pages):
        members = sorted(plan.order[start:start + size])
        out[tuple(names[i] for i in members)] = pages * page_size
        start += size
    return out


def run_layers(backend, batch: ForwardBatch, qkv) -> List[torch.Tensor]:
    """One step through every layer: the backend's plan once, then each layer's store-and-attend."""
    meta = backend.prepare(batch)
    return [backend.forward(q, k, v, layer, meta) for layer, (q, k, v) in enumerate(qkv)]


def random_qkv(sc: SharedPrefixScene, t: int, hq: int) -> list:
    h, d = sc.pool.num_kv_heads, sc.pool.head_dim
    return [(sc.randn(t, hq, d), sc.randn(t, h, d), sc.randn(t, h, d)) for _ in range(NUM_LAYERS)]
