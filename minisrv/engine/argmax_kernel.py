"""Greedy decoding's argmax over each row of the logits, in two short Triton kernels (CUDA; the sampler imports this
only there and only where Triton is installed).

Why: a decode step of one request takes the argmax of one row of 128K logits, and torch's reduction kernel does
that with too few threads for the row's length (tens of microseconds, once every step, for a step of a few
milliseconds). Here the row is cut into blocks of BLOCK values, one program each (the block's maximum and where it
is), then one program a row picks the block with the largest maximum. Ties go to the lowest index, as torch's
argmax does: the first block holding the maximum, the first position within it.
"""
import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits a program of the first kernel reads


@triton.jit
def block_max_kernel(logits_ptr, values_ptr, indices_ptr, vocab, row_stride, blocks, BLOCK: tl.constexpr):
    """Program (row, block): the largest logit of its block of the row and its index in the row."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    x = tl.where(inside, x, float("-inf"))
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(values_ptr + row * blocks + block, value.to(tl.float32))
    tl.store(indices_ptr + row * blocks + block, block * BLOCK + index)


@triton.jit
def pick_block_kernel(values_ptr, indices_ptr, out_ptr, blocks, BLOCKS: tl.constexpr):
    """Program row: the index of the block maximum that is largest (the first such block)."""
    row = tl.program_id(0)
    b = tl.arange(0, BLOCKS)
    values = tl.load(values_ptr + row * blocks + b, mask=b < blocks, other=float("-inf"))
    best = tl.argmax(values, axis=0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(indices_ptr + row * blocks + best).to(tl.int64))


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (float32, bf16 or float16; rows contiguous) -> int64 [B], the index of each row's largest value
    (the lowest index among equal ones). Rows must hold no NaN (torch's argmax would return a NaN's index)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    blocks = triton.cdiv(vocab, BLOCK)
    values = torch.empty((rows, blocks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((rows, blocks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block_max_kernel[(rows, blocks)](logits, values, indices, vocab, logits.stride(0), blocks, BLOCK=BLOCK,
                                         num_warps=8)
        pick_block_kernel[(rows,)](values, indices, out, blocks, BLOCKS=max(16, triton.next_power_of_2(blocks)),
                                   num_warps=1)
    return out
