"""The experts' alignment: a step's T*k (token, expert) pairs grouped by expert, each group padded to a multiple of
BLOCK_M rows, so that the grouped GEMM (kernels/moe_gemm.py) can give each program BLOCK_M rows of one expert.

Outputs (`Aligned`), all on the device and sized on the host from (T*k, E, BLOCK_M) alone:
- sorted_pairs int32 [max_padded(...)]: pair indices t * k + j grouped by expert; a group's padding holds T*k (out
  of range, so the GEMMs mask it); entries past the padded total are never read (and are left unwritten);
- expert_ids int32 [max_padded(...) / BLOCK_M]: each block's expert; -1 past the padded total;
- num_padded int32 [1]: the padded total, which the GEMMs read to let programs past it exit at once.

Why one Triton program: at decode (a few to a few hundred pairs) this step is pure latency. One program counts the
pairs per expert (tl.histogram), pads and prefix-sums the counts in registers, writes the block table and the
padding, and places each pair with an atomic increment of its expert's cursor: one launch, no host sync (so it is
captured in CUDA graphs), 3-6 us on an H100 up to 64 tokens of top-8 (torch ops: 50-80 us). Prefill-sized steps
(more than ONE_PROGRAM_PAIRS pairs) split the same steps over three launches (see triton_align). Atomics make the
order of pairs within a group vary from run to run; the results do not, since each GEMM output row depends only on
its own input row. `align_reference` is the same step in torch ops (stable: pairs in index order within a group),
checked against the same invariants in the tests.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch


class Aligned(NamedTuple):
    """The pairs grouped by expert (see the module docstring)."""

    sorted_pairs: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor


def max_padded(n_pairs: int, num_experts: int, block_m: int) -> int:
    """The most padded rows n_pairs pairs can take over num_experts experts: with c_e pairs on expert e, the padded
    total is sum over the m <= min(n_pairs, E) experts hit of ceil(c_e / BLOCK_M) blocks, at most
    m + (n_pairs - m) // BLOCK_M blocks, which grows with m. (Tighter than n_pairs + E * (BLOCK_M - 1) at decode:
    one token of top-8 takes 8 blocks, not 128, so the GEMMs' grids hold fewer idle programs.)"""
    m = min(n_pairs, num_experts)
    return (m + (n_pairs - m) // block_m) * block_m


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """The alignment in torch ops (a stable argsort by expert; no host sync): pairs of an expert in index order,
    padding entries and entries past the padded total = T*k."""
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    grouped = flat[order]
    # the i-th pair in expert order goes to its group's padded start plus its place within the group
    slot = (ends - padded)[grouped] + torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[grouped]
    size = max_padded(n, num_experts, block_m)
    sorted_pairs = torch.full((size,), n, dtype=torch.int32, device=dev).scatter_(0, slot, order.int())
    first_rows = torch.arange(0, size, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, first_rows, right=True)
    total = ends[-1:]
    expert_ids = torch.where(first_rows < total, expert_ids, -1).int()
    return Aligned(sorted_pairs, expert_ids, total.int())


ONE_PROGRAM_PAIRS = 2048  # up to this many pairs (256 tokens of top-8) one program aligns them, in one launch
# (H100, 128 experts: one program 3.4 / 6.5 / 13.9 / 22.4 / 75.5 us at 8 / 512 / 2,048 / 4,096 / 16,384 pairs,
# three launches 7.7 / 12.3 / 17.3 / 16.8 / 20.0 us, 40 us at 65,536; torch ops 52-143 us)
CHUNK = 1024  # pairs a step (one program's loop) or a program (the parallel kernels)


@functools.lru_cache(maxsize=None)
def triton_align() -> Optional[Callable[..., Aligned]]:
    """The launcher `run(topk_ids, num_experts, block_m, one_program=None)` -> Aligned, or None where Triton is
    missing. Up to ONE_PROGRAM_PAIRS pairs (unless one_program says otherwise) one program does it all; beyond, its
    loops over the pairs are latency-bound (H100: 76 us for 16,384 pairs, 287 us for 65,536), so three launches
    split them (20 and 40 us): per-chunk counts added atomically into zeroed counters, one program for the block
    table, then per-chunk placement."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means "not present"
        return None

    @triton.jit
    def moe_align(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, cursor_ptr, n_pairs, num_experts,
                  n_blocks, PHASE: tl.constexpr, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCKS: tl.constexpr):
        """PHASE 0: everything, one program looping over the pairs CHUNK at a time. The three launches of large
        steps, each program one CHUNK of pairs: 1, count them into counts (zeroed); 2 (one program), the block table
        from the counts; 3, place them. EXPERTS: num_experts rounded up to a power of two."""
        experts = tl.arange(0, EXPERTS)
        if PHASE == 0:
            lo = 0
            hi = n_pairs
        else:
            lo = tl.program_id(0) * CHUNK
            hi = lo + CHUNK
        if PHASE <= 1:
            counts = tl.zeros([EXPERTS], dtype=tl.int32)
            for start in range(lo, hi, CHUNK):
                offs = start + tl.arange(0, CHUNK)
                ok = offs < n_pairs
                ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
                # the lanes past the pairs read expert 0: taken off its count (histogram's mask is Triton 3.4+)
                counts += tl.histogram(ids, EXPERTS) - tl.where(experts == 0, tl.sum((~ok).to(tl.int32), 0), 0)
            if PHASE == 1:
                tl.atomic_add(counts_ptr + experts, counts, mask=experts < num_experts)
        if PHASE == 2:
            counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
        if PHASE == 0 or PHASE == 2:
            padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            ends = tl.cumsum(padded, 0)
            starts = ends - padded
            total = tl.sum(padded, 0)
            tl.store(num_padded_ptr, total)
            # each block's expert: the number of groups that end at or before the block's first row
            for b0 in range(0, n_blocks, BLOCKS):
                blocks = b0 + tl.arange(0, BLOCKS)
                first = blocks * BLOCK_M
                e = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
                tl.store(expert_ids_ptr + blocks, tl.where(first < total, e, -1), mask=blocks < n_blocks)
            # each group's padding: the slots after its pairs, up to its padded end
            pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
            tl.store(sorted_ptr + pad, tl.zeros_like(pad) + n_pairs, mask=pad < ends[:, None])
            # the cursors: each group's first slot
            tl.store(cursor_ptr + experts, starts, mask=experts < num_experts)
        if PHASE == 0:
            tl.debug_barrier()  # the cursors are in memory before any thread's atomics
        if PHASE == 0 or PHASE == 3:
            for start in range(lo, hi, CHUNK):  # each pair to the next free slot of its group
                offs = start + tl.arange(0, CHUNK)
                ok = offs < n_pairs
                ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
                slot = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
                tl.store(sorted_ptr + slot, offs, mask=ok)

    def run(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_program: Optional[bool] = None) -> Aligned:
        ids = topk_ids.reshape(-1)
        n = ids.numel()
        size = max_padded(n, num_experts, block_m)
        dev = ids.device
        sorted_pairs = torch.empty(size, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=dev)
        num_padded = torch.empty(1, dtype=torch.int32, device=dev)
        cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
        args = (sorted_pairs, expert_ids, num_padded, cursor, n, num_experts, size // block_m)
        consts = dict(BLOCK_M=block_m, EXPERTS=triton.next_power_of_2(num_experts), BLOCKS=64)
        if n <= ONE_PROGRAM_PAIRS if one_program is None else one_program:
            moe_align[(1,)](ids, cursor, *args, PHASE=0, CHUNK=min(CHUNK, max(64, triton.next_power_of_2(n))),
                            num_warps=8 if n > 256 else 4, **consts)
        else:
            counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
            grid = (triton.cdiv(n, CHUNK),)
            moe_align[grid](ids, counts, *args, PHASE=1, CHUNK=CHUNK, num_warps=4, **consts)
            moe_align[(1,)](ids, counts, *args, PHASE=2, CHUNK=CHUNK, num_warps=8, **consts)
            moe_align[grid](ids, counts, *args, PHASE=3, CHUNK=CHUNK, num_warps=4, **consts)
        return Aligned(sorted_pairs, expert_ids, num_padded)

    return run
