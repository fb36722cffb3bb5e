"""The experts' alignment: a step's T*k (token, expert) pairs grouped by expert, each group padded to a multiple of
BLOCK_M rows, so that the grouped GEMM (kernels/moe_gemm.py) can give each program BLOCK_M rows of one expert.

Outputs (`Aligned`), all on the device and sized on the host from (T*k, E, BLOCK_M) alone:
- sorted_pairs int32 [max_padded(...)]: pair indices t * k + j grouped by expert; a group's padding holds T*k (out
  of range, so the GEMMs mask it); entries past the padded total are never read (and are left unwritten);
- expert_ids int32 [max_padded(...) / BLOCK_M]: each block's expert; -1 past the padded total;
- num_padded int32 [1]: the padded total, which the GEMMs read to let programs past it exit at once.

Why one launch: at decode (a few to a few hundred pairs) this step is pure latency. Each program of the launch
counts the pairs per expert (tl.histogram) and those ahead of its PIECE of pairs, pads and prefix-sums the counts in
registers, writes its share of the block table, and places its pairs: at its group's start, after the pairs of the
same expert ahead of it. No atomics, so pairs keep index order within a group, as `align_reference`'s (the tests
compare the two exactly); no host sync, so it is captured in CUDA graphs. Every program reads all the pairs, so
prefill-sized steps (more than ONE_LAUNCH_PAIRS pairs) take three launches instead (see triton_align), placing pairs
with atomic cursors: their order within a group varies from run to run, the results do not, since each GEMM output
row depends only on its own input row.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, NamedTuple, Optional

import torch

from minisrv.kernels.triton_launcher import triton_launcher


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


ONE_LAUNCH_PAIRS = 8192  # up to this many pairs (1,024 tokens of top-8) one launch aligns them (docs/kernels.md)
CHUNK = 1024  # pairs a step of the counting loops, or a program of the three launches
PIECE = 64  # pairs a program of the one launch places


def aligned_buffers(n_pairs: int, num_experts: int, block_m: int, device: torch.device) -> Aligned:
    """The outputs' buffers, unfilled, sized from the shapes alone (so that CUDA graphs capture them)."""
    size = max_padded(n_pairs, num_experts, block_m)
    return Aligned(torch.empty(size, dtype=torch.int32, device=device),
                   torch.empty(size // block_m, dtype=torch.int32, device=device),
                   torch.empty(1, dtype=torch.int32, device=device))


@triton_launcher
def triton_align(triton: ModuleType, tl: ModuleType) -> Callable[..., Aligned]:
    """The launcher `run(topk_ids, num_experts, block_m, one_launch=None)` -> Aligned, or None where Triton is
    missing. Up to ONE_LAUNCH_PAIRS pairs (unless one_launch says otherwise) one launch of cdiv(pairs, PIECE) programs
    does it all; beyond, each of its programs would count every pair, so three launches split the work: per-chunk
    counts added atomically into zeroed counters, one program for the block table, then per-chunk placement through
    atomic cursors. The kernel: moe_device.moe_align."""
    from minisrv.kernels.moe_device import moe_align

    def run(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_launch: Optional[bool] = None) -> Aligned:
        ids = topk_ids.reshape(-1)
        n = ids.numel()
        dev = ids.device
        out = aligned_buffers(n, num_experts, block_m, dev)
        cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
        args = (*out, cursor, n, num_experts, out.expert_ids.numel())
        consts = dict(BLOCK_M=block_m, EXPERTS=triton.next_power_of_2(num_experts), BLOCKS=64)
        if n <= ONE_LAUNCH_PAIRS if one_launch is None else one_launch:
            piece = min(PIECE, max(16, triton.next_power_of_2(n)))
            moe_align[(triton.cdiv(n, piece),)](ids, cursor, *args, PHASE=0, PIECE=piece,
                                                CHUNK=min(CHUNK, max(64, triton.next_power_of_2(n))),
                                                num_warps=8 if n > 256 else 4, **consts)
        else:
            counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
            grid = (triton.cdiv(n, CHUNK),)
            moe_align[grid](ids, counts, *args, PHASE=1, CHUNK=CHUNK, PIECE=PIECE, num_warps=4, **consts)
            moe_align[(1,)](ids, counts, *args, PHASE=2, CHUNK=CHUNK, PIECE=PIECE, num_warps=8, **consts)
            moe_align[grid](ids, counts, *args, PHASE=3, CHUNK=CHUNK, PIECE=PIECE, num_warps=4, **consts)
        return out

    return run
