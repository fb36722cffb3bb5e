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
wrapper of each sort, planned over the same pages, and a layer runs on its kind's (Gemma 2 and 3: two). Cascade decode
serves models of one kind without a window.

CUDA graphs: a FlashInfer decode wrapper in CUDA-graph mode is bound to one batch size (its indptr buffer has
B+1 entries), so one wrapper is made per captured batch size, all sharing fixed index buffers and the workspace.
`plan` never runs inside a capture: `prepare_for_capture` plans before the caller starts capturing, and
`prepare_for_replay` re-plans (rewriting those fixed buffers and FlashInfer's own plan buffers) before replay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from minisrv.utils import ceil_div, to_device

from minisrv.batch import ForwardBatch, PrefixGroups

from .base import AttentionBackend

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class FIMeta:
    loc: torch.Tensor  # [T] slots the step's k/v go to
    wrappers: Tuple[Any, ...]  # per kind of layer, its wrapper planned for this step (the plan is FlashInfer's state)
    kv_indices: torch.Tensor  # this step's page ids, kept alive while the wrappers may read them

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

    def __init__(self, pool, req_to_token: torch.Tensor, num_q_heads: int, layers=None) -> None:
        super().__init__(pool, req_to_token, num_q_heads, layers)
        import flashinfer

        self.kinds = tuple(dict.fromkeys(self.layers))  # each kind of layer's attention, once
        self.kind_of = [self.kinds.index(a) for a in self.layers]
        self.supports_cascade = len(self.kinds) == 1 and self.kinds[0].window is None

        self._fi = flashinfer
        self.page_size = pool.page_size
        self.dtype = pool.dtype
        self.kv_dtype = pool.kv_dtype
        self.device = req_to_token.device
        self.use_tensor_cores = num_q_heads // self.num_kv_heads >= 4
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # (a step's wrappers share the workspace: its layers run one after another)
        self.prefill_wrappers = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
                                 for _ in self.kinds]
        self.decode_wrappers = [flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores) for _ in self.kinds]
        self.shared_wrapper = None  # the shared level of cascade decode (init_cascade_state)
        # CUDA-graph state
        self.graph_wrappers: Dict[int, List[Any]] = {}
        self.g_kv_indptr: Optional[torch.Tensor] = None
        # plan() fills pinned host buffers and queues copies from them; with overlap scheduling the next plan
        # can come before the device has run those copies, so each plan first waits for the previous one's
        self._plan_done: Optional[torch.cuda.Event] = None

    def _before_plan(self) -> None:
        if self._plan_done is not None:
            self._plan_done.synchronize()

    def _after_plan(self) -> None:
        if self.device.type != "cuda":
            return  # nothing runs ahead of the host
        self._plan_done = torch.cuda.Event()
        self._plan_done.record()

    def _host_kv_meta(self, seq_lens: List[int]) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """kv_indptr [B+1] and kv_last_page_len [B], int32 on the host, and the total page count."""
        ps = self.page_size
        indptr = [0]
        last = []
        for s in seq_lens:
            n = ceil_div(s, ps)
            indptr.append(indptr[-1] + n)
            last.append(s - (n - 1) * ps)
        return (torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32), indptr[-1])

    def _page_ids(self, rows: torch.Tensor, seq_lens: torch.Tensor, total: int) -> torch.Tensor:
        """kv_indices [total] int32 on the device: request i contributes req_to_token[row_i, 0:len_i:ps] // ps."""
        ps = self.page_size
        n_pages = (seq_lens.to(torch.int64) + (ps - 1)) // ps  # [B]
        return self._gather_pages(rows, None, n_pages, total)

    def _gather_pages(self, rows: torch.Tensor, first: Optional[torch.Tensor], counts: torch.Tensor,
                      total: int) -> torch.Tensor:
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
        slots = self.req_to_token[rows[entry], col * ps]
        return slots if ps == 1 else slots // ps

    def _plan_decode(self, wrappers: Sequence[Any], kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     kv_last: torch.Tensor) -> None:
        self._before_plan()
        for wrapper, a in zip(wrappers, self.kinds):
            wrapper.plan(kv_indptr, kv_indices, kv_last,
                         self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size,
                         pos_encoding_mode="NONE", window_left=a.window_left, logits_soft_cap=a.softcap,
                         q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=a.scale)
        self._after_plan()

    def prepare(self, b: ForwardBatch) -> Any:
        if b.is_decode and b.prefix_groups is not None:
            return self._prepare_cascade(b, b.prefix_groups)
        kv_indptr, kv_last, total = self._host_kv_meta(b.seq_lens_cpu)
        kv_indices = self._page_ids(b.req_rows, b.seq_lens, total)
        if b.is_decode:
            self._plan_decode(self.decode_wrappers, kv_indptr, kv_indices, kv_last)
            return FIMeta(b.out_cache_loc, tuple(self.decode_wrappers), kv_indices)
        qo_indptr = torch.tensor(_prefix_sums(b.extend_lens_cpu), dtype=torch.int32)
        self._before_plan()
        for wrapper, a in zip(self.prefill_wrappers, self.kinds):
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last,
                         self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size,
                         causal=True, pos_encoding_mode="NONE", sm_scale=a.scale, window_left=a.window_left,
                         logits_soft_cap=a.softcap, q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        self._after_plan()
        return FIMeta(b.out_cache_loc, tuple(self.prefill_wrappers), kv_indices)

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
        own_indptr = _prefix_sums(count)
        own_last = [s - (n - 1) * ps for s, n in zip(seq, pages)]
        qo_indptr = _prefix_sums(groups.sizes)
        shared_indptr = _prefix_sums(groups.shared_pages)
        inverse = [0] * bs
        for row, i in enumerate(order):
            inverse[i] = row
        idx = to_device(order + inverse + first + count + groups.leaders() + list(groups.shared_pages),
                        torch.int64, self.device)
        order_t, inverse_t = idx[:bs], idx[bs:2 * bs]
        own_indices = self._gather_pages(b.req_rows[order_t], idx[2 * bs:3 * bs], idx[3 * bs:4 * bs],
                                         own_indptr[-1])
        shared_indices = self._gather_pages(b.req_rows[idx[4 * bs:4 * bs + ng]], None, idx[4 * bs + ng:],
                                            shared_indptr[-1])
        if self.shared_wrapper is None:
            self.init_cascade_state()
        i32, a = torch.int32, self.kinds[0]  # (cascade steps are planned for a model of one kind without a window)
        self._before_plan()
        self.decode_wrappers[0].plan(torch.tensor(own_indptr, dtype=i32), own_indices,
                                     torch.tensor(own_last, dtype=i32), self.num_q_heads, self.num_kv_heads,
                                     self.head_dim, ps, pos_encoding_mode="NONE", logits_soft_cap=a.softcap,
                                     q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=a.scale)
        self.shared_wrapper.plan(torch.tensor(qo_indptr, dtype=i32), torch.tensor(shared_indptr, dtype=i32),
                                 shared_indices, torch.full((ng,), ps, dtype=i32),
                                 self.num_q_heads, self.num_kv_heads, self.head_dim, ps,
                                 causal=False, pos_encoding_mode="NONE", sm_scale=a.scale, logits_soft_cap=a.softcap,
                                 q_data_type=self.dtype, kv_data_type=self.dtype)
        self._after_plan()
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
        if k is not None:
            self.pool.store(layer_id, meta.loc, k, v)
        kv, kind = (self.pool.k[layer_id], self.pool.v[layer_id]), self.kind_of[layer_id]
        if not self.pool.quantized:
            return meta.run(q, kv, kind)
        return meta.run(q, kv, kind, k_scale=self.pool.k_scale_host[layer_id],
                        v_scale=self.pool.v_scale_host[layer_id])

    def kv_store_target(self, layer_id: int, meta: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return self._pool_target(layer_id, meta.loc)

    # -- CUDA graphs (decode) -------------------------------------------------------------------------------

    def init_graph_state(self, max_bs: int, max_seq_len: int) -> None:
        self.g_max_bs = max_bs
        self.g_max_pages = ceil_div(max_seq_len, self.page_size)
        self.g_kv_indptr = torch.zeros((max_bs + 1,), dtype=torch.int32, device=self.device)
        self.g_kv_indices = torch.zeros((max_bs * self.g_max_pages,), dtype=torch.int32, device=self.device)
        self.g_kv_last = torch.ones((max_bs,), dtype=torch.int32, device=self.device)
        self.graph_wrappers = {}

    def _graph_wrappers(self, bs: int) -> List[Any]:
        """The batch-size-`bs` graph's wrapper of each kind of layer: all read the same fixed index buffers."""
        w = self.graph_wrappers.get(bs)
        if w is None:
            if self.g_kv_indptr is None:
                raise RuntimeError("init_graph_state must be called before capture")
            if bs > self.g_max_bs:
                raise ValueError(f"batch size {bs} exceeds the graph state's max_bs {self.g_max_bs}")
            w = [self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self.g_kv_indptr[:bs + 1],
                paged_kv_indices_buffer=self.g_kv_indices,
                paged_kv_last_page_len_buffer=self.g_kv_last[:bs]) for _ in self.kinds]
            self.graph_wrappers[bs] = w
        return w

    def _plan_graph(self, b: ForwardBatch, wrappers: Sequence[Any], padded_bs: int) -> torch.Tensor:
        bs = b.batch_size
        if padded_bs < bs:
            raise ValueError(f"padded batch size {padded_bs} < batch size {bs}")
        if b.max_seq_len > self.g_max_pages * self.page_size:
            raise ValueError(f"sequence length {b.max_seq_len} exceeds the graph's max_seq_len")
        pad = padded_bs - bs
        # padding rows: one token on page 0 (any valid page will do; their outputs are dropped)
        kv_indptr, kv_last, total = self._host_kv_meta(list(b.seq_lens_cpu) + [1] * pad)
        real = total - pad
        kv_indices = self._page_ids(b.req_rows[:bs], b.seq_lens[:bs], real)
        if pad:
            kv_indices = torch.cat([kv_indices, kv_indices.new_zeros(pad)])
        self._plan_decode(wrappers, kv_indptr, kv_indices, kv_last)
        return kv_indices

    def prepare_for_capture(self, b: ForwardBatch) -> Any:
        """Plan the batch-size-`bs` graph wrapper; call before capture begins (FlashInfer plans on the host)."""
        if not b.is_decode:
            raise ValueError("CUDA graphs capture decode batches only")
        wrappers = self._graph_wrappers(b.batch_size)
        return FIMeta(b.out_cache_loc, tuple(wrappers), self._plan_graph(b, wrappers, b.batch_size))

    def prepare_for_replay(self, b: ForwardBatch, padded_bs: int, meta: Any) -> None:
        # the plan copies the page ids into the wrappers' fixed buffer (stream-ordered), which the graph reads
        self._plan_graph(b, meta.wrappers, padded_bs)


def _prefix_sums(counts: Sequence[int]) -> List[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out
