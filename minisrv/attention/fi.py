"""FlashInfer over the paged pool: a paged prefill wrapper for extend steps, a paged decode wrapper for decode.

FlashInfer describes the paged KV cache in CSR form: `kv_indptr` [B+1], `kv_indices` (the page ids, request after
request) and `kv_last_page_len` [B]; extend steps add `qo_indptr` [B+1]. A step is planned once in `prepare` (every
layer shares the plan): the indptrs come from the batch's host-side lengths, the page ids are gathered on the device
from the request->token table with no host round trip.

Cascade decode (a step whose batch carries `prefix_groups`, see cascade.py): each request's own pages (those past
its group's shared ones) go through the decode wrapper, which also returns the log-sum-exp of every row; each
group's shared pages go through a prefill wrapper whose queries are the group's members (non-causal: every shared
token precedes them), read once per group instead of once per request; the two results are merged in place with
`merge_state_in_place`. The prefill wrapper needs each group's queries contiguous, so q runs in the plan's order
(groups first) and the output is put back in batch order. Requests in no group are left out of the shared level
altogether rather than given an empty one: FlashInfer does not define the output or log-sum-exp of attention over
no keys. Such steps run eagerly (the CUDA-graph runner refuses them); an FP8 pool does not use cascade.

With an FP8 pool the wrappers are planned with `kv_data_type=float8_e4m3fn` and q in the model's dtype (FlashInfer
then picks its FA2-style kernels, which convert K/V to q's dtype as they load them), and each run gets the layer's
scales as the floats `k_scale` and `v_scale`. On Hopper the registry gives such decode steps to xqa.py instead.

Layers whose attention differs (a sliding window, a soft-cap or a scale of their own: attention_options.py) need
wrappers planned apart (FlashInfer picks its kernel at plan time), so each kind of layer the model has gets its own
wrapper of each sort, and a layer runs on its kind's (Gemma 2 and 3: two). Cascade decode serves models of one kind
without a window.

Where the pool's windowed layers keep only their window (kvcache/pool.py), their kinds read pages of their own, which
the second request->token table (`window_table`) maps: a step lists its pages of each table once (`PageList`), every
kind's wrapper is planned over its table's list, and the windowed layers store the step's K/V at their own slots. A
request's windowed pages are listed from the one its first query's window starts in (the widest window's, as
kvcache/window.py gives the others back): FlashInfer aligns a causal query to the end of its keys, so listing fewer
leading keys moves no query, and window_left keeps each query within its window. A model without windowed pages
lists and plans exactly one table, as it would without them.

CUDA graphs: a FlashInfer decode wrapper in CUDA-graph mode is bound to one batch size (its indptr buffer has
B+1 entries), so one wrapper is made per captured batch size and kind, all sharing the workspace and, per table, fixed
index buffers. `plan` never runs inside a capture: `prepare_for_capture` plans before the caller starts capturing, and
`prepare_for_replay` re-plans (rewriting those fixed buffers and FlashInfer's own plan buffers) before replay. The
windowed layers' slots of a graph's tokens sit in a fixed buffer too, gathered again before each replay from the
window table at the rows and positions the graph's inputs then hold (padding rows: the pad row's first slot).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from minisrv.batch import ForwardBatch, PrefixGroups
from minisrv.kvcache import WindowRule
from minisrv.utils import ceil_div, to_device

from .base import AttentionBackend
from .page_table import window_slots

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class PageList:
    """A step's pages of one request->token table in FlashInfer's CSR form."""

    indptr: torch.Tensor  # [B+1] int32 on the host
    last: torch.Tensor  # [B] int32 on the host: keys on each request's last page
    indices: torch.Tensor  # page ids, request after request, int32 on the device


@dataclass(frozen=True)
class FIMeta:
    loc: torch.Tensor  # [T] slots the step's k/v go to
    window_loc: Optional[torch.Tensor]  # [T] the windowed layers' own slots of them (None: the pool has none)
    wrappers: Tuple[Any, ...]  # per kind of layer, its wrapper planned for this step (the plan is FlashInfer's state)
    pages: Tuple[PageList, ...]  # this step's page lists, kept alive while the wrappers may read them

    def run(self, q: torch.Tensor, kv: Tuple[torch.Tensor, torch.Tensor], kind: int, **scales: float) -> torch.Tensor:
        """scales: an FP8 pool's k_scale and v_scale."""
        return self.wrappers[kind].run(q, kv, **scales)


@dataclass(frozen=True)
class FICascadeMeta:
    """A cascade decode step: rows run in the plan's order, in which each group's members are contiguous."""

    loc: torch.Tensor  # [B] slots the step's k/v go to (batch order)
    own: Any  # decode wrapper over each request's pages past its group's shared ones, rows in cascade order
    shared: Any  # prefill wrapper over each group's shared pages, with the group's members as its queries
    merge: Callable  # flashinfer.merge_state_in_place
    num_grouped: int  # cascade rows [0, num_grouped) belong to a group, in group order
    order: Optional[torch.Tensor]  # [B] int64 batch row of each cascade row (None: the batch is in cascade order)
    inverse: Optional[torch.Tensor]  # [B] int64 cascade row of each batch row
    kv_indices: Tuple[torch.Tensor, torch.Tensor]  # own and shared page ids, kept alive while the wrappers read them

    def run(self, q: torch.Tensor, kv: Tuple[torch.Tensor, torch.Tensor], kind: int = 0) -> torch.Tensor:
        qc = q if self.order is None else q[self.order]
        out, lse = self.own.run(qc, kv, return_lse=True)
        g = self.num_grouped
        out_shared, lse_shared = self.shared.run(qc[:g], kv, return_lse=True)
        # both log-sum-exps are FlashInfer's (base 2); the merge rewrites the grouped rows of out (and lse) in place
        self.merge(out[:g], lse[:g], out_shared, lse_shared)
        return out if self.inverse is None else out[self.inverse]


class FlashInferBackend(AttentionBackend):
    name = "fi"
    supports_cuda_graph = True
    supports_cascade = True
    decode_kernel = "flashinfer"  # the kernel its decode steps run

    def __init__(self, pool, req_to_token: torch.Tensor, num_q_heads: int, layers=None,
                 window_table: Optional[torch.Tensor] = None) -> None:
        super().__init__(pool, req_to_token, num_q_heads, layers)
        import flashinfer

        self.kinds = tuple(dict.fromkeys(self.layers))  # each kind of layer's attention, once
        self.kind_of = [self.kinds.index(a) for a in self.layers]
        self.supports_cascade = len(self.kinds) == 1 and self.kinds[0].window is None
        # which kinds read the window table's pages (all of a kind's layers keep their window or none do), and the
        # widest of their windows, from whose start a request's windowed pages are listed
        self.window_table = window_table
        windowed = {self.kind_of[i] for i in pool.window_layers} if window_table is not None else set()
        if any((k in windowed) != (i in pool.window_layers) for i, k in enumerate(self.kind_of) if windowed):
            raise ValueError("layers of one kind of attention must all keep only their window, or none")
        self.windowed = tuple(k in windowed for k in range(len(self.kinds)))
        self.window = max((self.kinds[k].window for k in windowed), default=None)
        self.tables = tuple(sorted(set(self.windowed)))  # the tables a step lists pages of: (False,) without windows

        self._fi = flashinfer
        self.dtype = pool.dtype
        self.use_tensor_cores = num_q_heads // self.num_kv_heads >= 4
        # each kind's plan arguments besides its pages (FlashInfer picks its kernel at plan time)
        self.heads = (num_q_heads, self.num_kv_heads, self.head_dim, self.page_size)
        self.plan_opts = [dict(pos_encoding_mode="NONE", window_left=a.window_left, logits_soft_cap=a.softcap,
                               q_data_type=pool.dtype, kv_data_type=pool.kv_dtype, sm_scale=a.scale)
                          for a in self.kinds]
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # (a step's wrappers share the workspace: its layers run one after another)
        self.prefill_wrappers = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
                                 for _ in self.kinds]
        self.decode_wrappers = [flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores) for _ in self.kinds]
        self.shared_wrapper = None  # the shared level of cascade decode (init_cascade_state)
        # CUDA-graph state: per table, its fixed (indptr, indices, last page length) buffers; per batch size, its
        # wrappers and the batch whose static inputs its graph reads
        self.graph_wrappers: Dict[int, List[Any]] = {}
        self.graph_batches: Dict[int, ForwardBatch] = {}
        self.g_buffers: Dict[bool, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # plan() fills pinned host buffers and queues copies from them; with overlap scheduling the next plan
        # can come before the device has run those copies, so each plan first waits for the previous one's
        self._plan_done: Optional[torch.cuda.Event] = None

    @contextlib.contextmanager
    def _planning(self) -> Iterator[None]:
        """Around a step's plans: wait for the previous plans' copies first, mark where these end after."""
        if self._plan_done is not None:
            self._plan_done.synchronize()
        yield
        if self.device.type == "cuda":  # (on the CPU nothing runs ahead of the host)
            self._plan_done = torch.cuda.Event()
            self._plan_done.record()

    def _page_list(self, b: ForwardBatch, windowed: bool, pad: int = 0) -> PageList:
        """The step's pages of the full table, or (windowed) of the window table from the page its first query's
        window starts in; then `pad` padding rows of one key on page 0. Lengths come from the host, page ids are
        gathered on the device."""
        ps = self.page_size
        first = [WindowRule(self.window, ps).first_page(p) for p in b.prefix_lens_cpu] if windowed \
            else [0] * b.batch_size
        indptr, last = [0], []
        for s, f in zip(b.seq_lens_cpu, first):
            n = ceil_div(s, ps)
            indptr.append(indptr[-1] + n - f)
            last.append(s - (n - 1) * ps)
        real = indptr[-1]
        indptr += range(real + 1, real + pad + 1)
        n_pages = (b.seq_lens.to(torch.int64) + (ps - 1)) // ps  # [B]
        if windowed:
            first_t = to_device(first, torch.int64, self.device)
            indices = self._gather_pages(self.window_table, b.req_rows, first_t, n_pages - first_t, real)
        else:
            indices = self._gather_pages(self.req_to_token, b.req_rows, None, n_pages, real)
        if pad:
            indices = torch.cat([indices, indices.new_zeros(pad)])
        i32 = torch.int32
        return PageList(torch.tensor(indptr, dtype=i32), torch.tensor(last + [1] * pad, dtype=i32), indices)

    def _gather_pages(self, table: torch.Tensor, rows: torch.Tensor, first: Optional[torch.Tensor],
                      counts: torch.Tensor, total: int) -> torch.Tensor:
        """kv_indices [total] int32 on the device: entry e contributes its table row rows[e]'s pages first[e] ..
        first[e] + counts[e] - 1 (from page 0 when first is None); repeat_interleave is given the output size, so
        nothing waits for the device."""
        ps = self.page_size
        dev = rows.device
        entry = torch.repeat_interleave(torch.arange(rows.numel(), device=dev), counts, output_size=total)
        starts = torch.cumsum(counts, 0) - counts
        col = torch.arange(total, device=dev) - starts[entry]
        if first is not None:
            col = col + first[entry]
        slots = table[rows[entry], col * ps]
        return slots if ps == 1 else slots // ps

    def _window_loc(self, b: ForwardBatch, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """page_table.window_slots, or None where the pool has no windowed pages."""
        return window_slots(self.window_table, b, out) if any(self.windowed) else None

    def _plan(self, wrappers: Sequence[Any], pages: Dict[bool, PageList], qo_indptr: Optional[torch.Tensor]) -> None:
        """Plan each kind's wrapper over its table's pages: decode wrappers, or (qo_indptr given) prefill ones."""
        with self._planning():
            for wrapper, opts, windowed in zip(wrappers, self.plan_opts, self.windowed):
                p = pages[windowed]
                kv = (p.indptr, p.indices, p.last, *self.heads)
                if qo_indptr is None:
                    wrapper.plan(*kv, **opts)
                else:
                    wrapper.plan(qo_indptr, *kv, causal=True, **opts)

    def prepare(self, b: ForwardBatch) -> Any:
        if b.is_decode and b.prefix_groups is not None:
            return self._prepare_cascade(b, b.prefix_groups)
        pages = {w: self._page_list(b, w) for w in self.tables}
        if b.is_decode:
            wrappers, qo_indptr = self.decode_wrappers, None
        else:
            wrappers = self.prefill_wrappers
            qo_indptr = torch.tensor(list(accumulate(b.extend_lens_cpu, initial=0)), dtype=torch.int32)
        self._plan(wrappers, pages, qo_indptr)
        return FIMeta(b.out_cache_loc, self._window_loc(b), tuple(wrappers), tuple(pages.values()))

    def _prepare_cascade(self, b: ForwardBatch, groups: PrefixGroups) -> FICascadeMeta:
        """Plan both levels of a cascade decode step. Every indptr comes from host-side lengths; the page ids are
        gathered on the device from the request->token table (the shared level's from each group's leader), after
        one host->device copy of the plan's indices."""
        ps, bs, ng = self.page_size, b.batch_size, groups.num_groups
        order = list(groups.order)
        first = groups.shared_pages_in_order()
        seq = [b.seq_lens_cpu[i] for i in order]
        pages = [ceil_div(s, ps) for s in seq]
        count = [n - f for n, f in zip(pages, first)]
        if len(order) != bs or min(count) < 1:
            raise ValueError("a cascade plan must cover the batch and leave each request the page it writes to")
        own_indptr = list(accumulate(count, initial=0))
        own_last = [s - (n - 1) * ps for s, n in zip(seq, pages)]
        qo_indptr = list(accumulate(groups.sizes, initial=0))
        shared_indptr = list(accumulate(groups.shared_pages, initial=0))
        inverse = sorted(range(bs), key=order.__getitem__)  # the cascade row of each batch row
        idx = to_device(order + inverse + first + count + groups.leaders() + list(groups.shared_pages),
                        torch.int64, self.device)
        order_t, inverse_t = idx[:bs], idx[bs:2 * bs]
        table = self.req_to_token
        own_indices = self._gather_pages(table, b.req_rows[order_t], idx[2 * bs:3 * bs], idx[3 * bs:4 * bs],
                                         own_indptr[-1])
        shared_indices = self._gather_pages(table, b.req_rows[idx[4 * bs:4 * bs + ng]], None, idx[4 * bs + ng:],
                                            shared_indptr[-1])
        if self.shared_wrapper is None:
            self.init_cascade_state()
        # (cascade steps are planned for a model of one kind without a window, over a pool of the model's dtype)
        i32, heads, opts = torch.int32, self.heads, self.plan_opts[0]
        with self._planning():
            self.decode_wrappers[0].plan(torch.tensor(own_indptr, dtype=i32), own_indices,
                                         torch.tensor(own_last, dtype=i32), *heads, **opts)
            self.shared_wrapper.plan(torch.tensor(qo_indptr, dtype=i32), torch.tensor(shared_indptr, dtype=i32),
                                     shared_indices, torch.full((ng,), ps, dtype=i32), *heads, causal=False, **opts)
        in_order = order == list(range(bs))
        return FICascadeMeta(b.out_cache_loc, self.decode_wrappers[0], self.shared_wrapper,
                             self._fi.merge_state_in_place,
                             groups.num_grouped, None if in_order else order_t, None if in_order else inverse_t,
                             (own_indices, shared_indices))

    def init_cascade_state(self) -> None:
        """The shared level's wrapper, and the merge kernel loaded (FlashInfer builds it on first use)."""
        self.shared_wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        v = torch.zeros((1, self.num_q_heads, self.head_dim), dtype=self.dtype, device=self.device)
        s = torch.zeros((1, self.num_q_heads), dtype=torch.float32, device=self.device)
        self._fi.merge_state_in_place(v, s, v.clone(), s.clone())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, meta: Any) -> torch.Tensor:
        kind = self.kind_of[layer_id]
        if k is not None:
            self.pool.store(layer_id, self._loc(meta, kind), k, v)
        kv = (self.pool.k[layer_id], self.pool.v[layer_id])
        if not self.pool.quantized:
            return meta.run(q, kv, kind)
        return meta.run(q, kv, kind, k_scale=self.pool.k_scale_host[layer_id], v_scale=self.pool.v_scale_host[layer_id])

    def _loc(self, meta: Any, kind: int) -> torch.Tensor:
        return meta.window_loc if self.windowed[kind] else meta.loc

    def kv_store_target(self, layer_id: int, meta: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return self._pool_target(layer_id, self._loc(meta, self.kind_of[layer_id]))

    # -- CUDA graphs (decode) -------------------------------------------------------------------------------

    def init_graph_state(self, max_bs: int, max_seq_len: int) -> None:
        self.g_max_bs = max_bs
        self.g_max_pages = ceil_div(max_seq_len, self.page_size)
        dev = self.device
        for windowed in self.tables:  # a windowed request lists at most the pages its window touches
            pages = min(self.g_max_pages, ceil_div(self.window, self.page_size) + 1) if windowed else self.g_max_pages
            self.g_buffers[windowed] = (torch.zeros((max_bs + 1,), dtype=torch.int32, device=dev),
                                        torch.zeros((max_bs * pages,), dtype=torch.int32, device=dev),
                                        torch.ones((max_bs,), dtype=torch.int32, device=dev))
        self.g_window_loc = torch.zeros((max_bs,), dtype=torch.int64, device=dev) if any(self.windowed) else None
        self.graph_wrappers, self.graph_batches = {}, {}

    def _graph_wrappers(self, bs: int) -> List[Any]:
        """The batch-size-`bs` graph's wrapper of each kind of layer: each reads its table's fixed index buffers."""
        w = self.graph_wrappers.get(bs)
        if w is None:
            if not self.g_buffers:
                raise RuntimeError("init_graph_state must be called before capture")
            if bs > self.g_max_bs:
                raise ValueError(f"batch size {bs} exceeds the graph state's max_bs {self.g_max_bs}")
            w = []
            for windowed in self.windowed:
                indptr, indices, last = self.g_buffers[windowed]
                w.append(self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                    paged_kv_indptr_buffer=indptr[:bs + 1], paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last[:bs]))
            self.graph_wrappers[bs] = w
        return w

    def _plan_graph(self, b: ForwardBatch, wrappers: Sequence[Any], padded_bs: int) -> Tuple[PageList, ...]:
        bs = b.batch_size
        if padded_bs < bs:
            raise ValueError(f"padded batch size {padded_bs} < batch size {bs}")
        if b.max_seq_len > self.g_max_pages * self.page_size:
            raise ValueError(f"sequence length {b.max_seq_len} exceeds the graph's max_seq_len")
        # padding rows: one key on page 0 (any valid page will do; their outputs are dropped)
        pages = {w: self._page_list(b, w, pad=padded_bs - bs) for w in self.tables}
        self._plan(wrappers, pages, None)
        return tuple(pages.values())

    def prepare_for_capture(self, b: ForwardBatch) -> Any:
        """Plan the batch-size-`bs` graph wrappers; call before capture begins (FlashInfer plans on the host)."""
        if not b.is_decode:
            raise ValueError("CUDA graphs capture decode batches only")
        bs = b.batch_size
        wrappers = self._graph_wrappers(bs)
        self.graph_batches[bs] = b
        window_loc = None if self.g_window_loc is None else self._window_loc(b, self.g_window_loc[:bs])
        return FIMeta(b.out_cache_loc, window_loc, tuple(wrappers), self._plan_graph(b, wrappers, bs))

    def prepare_for_replay(self, b: ForwardBatch, padded_bs: int, meta: Any) -> None:
        self._plan_graph(b, meta.wrappers, padded_bs)
        if meta.window_loc is not None:
            self._window_loc(self.graph_batches[padded_bs], meta.window_loc)
