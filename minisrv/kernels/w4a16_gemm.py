"""The W4A16 GEMM: y = x W for activations x [M, K] in bf16/fp16/fp32 and a 4-bit weight W [K, N] held in the
layout every 4-bit checkpoint format is repacked into at load (checkpoints/int4_formats.py):

- qweight int32 [K/8, N]: row k of W is nibble k % 8 (bits 4 * (k % 8)) of word [k // 8, n], values 0..15;
- scales [K/G, N] (float16 or bfloat16) and zeros uint8 [K/G, N]: W[k, n] = (q - zeros[k // G, n]) * scales[k // G, n]
  for groups of G consecutive rows of K (G = K: one scale per output column). Symmetric formats have zeros 8.

The same kernel reads a GGUF matrix kept in its blocks (`BlockPlanes`, models/gguf_planes.py): the low nibbles in
qweight's layout, the bits above them in a plane of the same kind, and the blocks' scales as planes [K/S, N]; each
sub-block of rows reads w = d sc (q - zero) - dmin mn, its format (`BlockFormat`) a set of compile-time constants.

Packing along K keeps a program's loads contiguous along N (its output columns), and a K step of the kernel
(BLOCK_K rows, BLOCK_K dividing G) falls inside one group, so it reads one row of scales and zeros; a GGUF step is
one sub-block on the CUDA cores, and spans several on the tensor cores, their scales read as a [BLOCK_K / S, BLOCK_N]
tile and spread over their rows.

Up to DEQUANTIZE_M rows, one Triton kernel with no bf16 weight in memory: one or two rows (decode) on the CUDA
cores, each thread holding whole columns of its tile so that the sum over K stays in the thread; more rows on the
tensor cores, each program dequantising a [BLOCK_K, BLOCK_N] tile in registers for tl.dot. Both read a nibble as
float32 by placing its bits under a float's exponent (no integer conversion). The CUDA cores' kernel also serves a
mixture of experts' decode: one program row per (token, expert) pair, each reading its expert's weight. Decode
batches have too few output tiles to occupy the GPU, so K is split over programs; the last program of a tile adds
the float32 partial sums in a fixed order (the same result at every run, eager or in a CUDA graph). Larger batches
(prefill) dequantise the weight into a transient bf16 buffer (the same kernel, storing its tiles) for torch's
matmul, as vLLM's AWQ path does past 256 tokens: there the matmul's own tiling reuses each weight across many rows
better than a fused kernel's dequantisation does.
Off CUDA (and as the tests' reference) the same arithmetic runs in torch: `dequantize` (`dequantize_planes`) then a
matmul.
"""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Callable, NamedTuple, Optional

import torch

from minisrv.kernels.triton_launcher import triton_launcher

GEMV_M = 2  # batches up to this many rows run on the CUDA cores' kernel
SPLIT_M = 64  # batches up to this many rows split K over programs
TARGET_PROGRAMS = 448  # split-K of 17-64 rows: the power of two that brings the programs nearest below this many
DEQUANTIZE_M = 128  # batches from this many rows dequantise the weight for torch's matmul


class W4A16Config(NamedTuple):
    """Launch parameters. block_m 0: dequantise W whole in [block_k, block_n] tiles, then torch's matmul."""

    block_m: int
    block_n: int
    block_k: int  # must divide the group size
    split_k: int  # programs sharing one output tile's K loop (1: none)
    num_warps: int
    num_stages: int


class BlockFormat(NamedTuple):
    """How a GGUF block type's planes read (the kernel's compile-time constants): per sub-block of `sub` rows,
    w = d sc (q - zero) - dmin mn, with q the low nibble plus `high_bits` more bits from the high plane, d (and dmin)
    one per `block` rows, sc a sub-block scale (`scaled`), and `mins`: 0 none, 1 dmin alone (mn = 1), 2 dmin mn."""

    high_bits: int
    sub: int
    block: int
    zero: int
    scaled: bool
    mins: int


class BlockPlanes(NamedTuple):
    """A GGUF matrix W [K, N] in its blocks: low int32 [K/8, N] (qweight's layout), high int32 [K b / 32, N] (b =
    high_bits: row k in bits b (k % (32 / b)) of word k // (32 / b)), d float16 [K/block, N], scales uint8 (int8
    for Q6_K) [K/sub, N], dmin float16 [K/block, N] and mins uint8 [K/32, N]; those the format lacks are None."""

    fmt: BlockFormat
    low: torch.Tensor
    d: torch.Tensor
    high: Optional[torch.Tensor] = None
    scales: Optional[torch.Tensor] = None
    dmin: Optional[torch.Tensor] = None
    mins: Optional[torch.Tensor] = None

    def columns(self, index: torch.Tensor) -> "BlockPlanes":
        """The planes of W's columns `index` (a GGUF embedding's rows)."""
        return BlockPlanes(self.fmt, *(t.index_select(1, index) if t is not None else None for t in self[1:]))


def unpack_rows(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """The `bits`-bit values of words [K b / 32, N] as uint8 [K, N] (row (32 / b) i + j: field j of row i's words;
    b = 4: qweight's nibbles)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [K b / 32, 32 / b, N]
    return values.reshape(-1, words.shape[1]).to(torch.uint8)


def pack_rows(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """uint8 values below 2^bits [K, N] (K a multiple of 32 / bits) packed into int32 [K b / 32, N]: the inverse of
    `unpack_rows`."""
    v = values.to(torch.int32).reshape(-1, 32 // bits, values.shape[1])
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=values.device)
    # the last field reaches the sign bit: the sum of the shifted fields wraps as the bit pattern it stands for
    return (v << shifts[None, :, None]).sum(dim=1, dtype=torch.int32)


def dequantize_planes(p: BlockPlanes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [K, N] in `dtype` from a GGUF matrix's planes (the kernel's arithmetic, in torch)."""
    f = p.fmt
    q = unpack_rows(p.low).to(dtype)
    if p.high is not None:
        q += unpack_rows(p.high, f.high_bits).to(dtype) * 16
    a = p.d.to(dtype).repeat_interleave(f.block, dim=0)
    if f.scaled:
        a = a * p.scales.to(dtype).repeat_interleave(f.sub, dim=0)
    w = (q - f.zero) * a
    if f.mins:
        dmin = p.dmin.to(dtype).repeat_interleave(f.block, dim=0)
        w -= dmin * p.mins.to(dtype).repeat_interleave(32, dim=0) if f.mins == 2 else dmin
    return w


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [K, N] in `dtype`: (q - zero) * scale of each element's group (the group size is K / scales' rows)."""
    q = unpack_rows(qweight)
    group = q.shape[0] // scales.shape[0]
    z = zeros.to(dtype).repeat_interleave(group, dim=0)
    s = scales.to(dtype).repeat_interleave(group, dim=0)
    return (q.to(dtype) - z) * s


def dequantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W in x's dtype, W dequantised in float32 and rounded to x's dtype as the kernel's tile is (the
    CPU's path, and the GPU's where Triton is missing)."""
    return x @ dequantize(qweight, scales, zeros).to(x.dtype)


def config_for(m: int, n: int, k: int, group: int) -> W4A16Config:
    """Launch parameters for [m, k] x [k, n] with groups of `group` rows. Up to GEMV_M rows: the CUDA cores'
    kernel, 64 columns and K steps of 64 a program (one warp), K split so that a program takes about two steps,
    in up to 64 shares (short programs, many in flight); up to SPLIT_M rows: 16-64-row tiles on the tensor cores,
    128 columns up to 16 rows and for wide outputs, else 64, K split (in 8 up to 16 rows, else in a power of two,
    programs up to TARGET_PROGRAMS: H100 sweeps of Llama-3-8B's projections, scripts/bench_w4a16.py); up to
    DEQUANTIZE_M: 64 or 128-row tiles of 128 columns, K steps of 64; more rows: the weight dequantised whole for
    torch's matmul, whose tiles reuse it better. (GGUF planes pass the largest power of 2 up to 256 dividing K as
    `group`: K steps of whole sub-blocks.)"""
    if m >= DEQUANTIZE_M:
        block_m, block_n, block_k, warps = 0, 128, 64, 4
    elif m <= GEMV_M:
        block_m, block_n, block_k, warps = m, 64, 64, 1
    elif m <= SPLIT_M:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n, block_k, warps = 128 if m <= 16 or n >= 16384 else 64, 128, 4
    else:
        block_m, block_n, block_k = (64 if m <= 128 else 128), 128, 64
        warps = 4 if block_m == 64 else 8
    while group % block_k:
        block_k //= 2
    if block_k < 16:
        raise ValueError(f"4-bit group of {group} rows: the kernel needs groups of a multiple of 16")
    if block_m == 0:
        return W4A16Config(0, block_n, block_k, 1, warps, 1)
    if m <= GEMV_M:  # about two K steps a program, at most 64 programs a tile
        return W4A16Config(block_m, block_n, block_k, min(max(1, k // block_k // 2), 64), warps, 2)
    tiles = -(-m // block_m) * -(-n // block_n)
    split = 1 if m > SPLIT_M else min(k // block_k, 8) if m <= 16 else \
        min(k // block_k, 1 << max(0, (TARGET_PROGRAMS // tiles).bit_length() - 1))
    return W4A16Config(block_m, block_n, block_k, split, warps, 3)


@triton_launcher
def w4a16_gemm(triton: ModuleType, tl: ModuleType) -> Callable[..., torch.Tensor]:
    """The launcher `run(x, weight, scales=None, zeros=None, config=None, out=None, ids=None, ...)` -> y [M, N] in
    x's dtype (written into `out`, a column slice of a wider output, where given), or None where Triton is missing.
    `weight`: a 4-bit qweight with its scales and zeros, or a GGUF matrix's BlockPlanes."""

    @triton.jit
    def w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, h_ptr, sc_ptr, dm_ptr, y_ptr, ws_ptr, cnt_ptr, ids_ptr, rw_ptr,
                          m, n, k, group, steps_per_split, stride_xm, stride_ym, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, TOP_K: tl.constexpr,
                          WEIGHTED: tl.constexpr, WHOLE: tl.constexpr, SUB: tl.constexpr,
                          HIGH: tl.constexpr, ZERO: tl.constexpr, SCALED: tl.constexpr, MINS: tl.constexpr):
        """Program (pid_m, pid_n, pid_k): output tile (pid_m, pid_n) over K steps [pid_k * steps_per_split, +
        steps_per_split). SPLIT > 1: ws_ptr holds [tiles, SPLIT, BLOCK_M * BLOCK_N] float32 partial sums and
        cnt_ptr a zeroed int32 counter per tile. TOP_K > 0 (BLOCK_M 1): row p is a (token, expert) pair of a
        mixture of experts, reading x's row p // TOP_K and expert ids[p]'s weight of stacked [E, K/8, N] ones.
        WEIGHTED: row p of the output scaled by rw[p] (float32). WHOLE: the program stores its dequantised
        [BLOCK_K, BLOCK_N] tiles of W into y [K, N] instead. SUB 0: a 4-bit weight
        (qw, scales s, zeros z); else a GGUF BlockFormat's planes (low qw, d s, mins z, high h, sub-block scales sc,
        dmin dm; group: the rows a d covers)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        KW: tl.constexpr = BLOCK_K // 8
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kw = tl.arange(0, KW)
        row_ok = rows < m
        col_ok = cols < n
        x_rows = rows
        if TOP_K > 0:
            expert = tl.load(ids_ptr + pid_m).to(tl.int64)
            qw_ptr += expert * (k // 8) * n
            s_ptr += expert * (k // group) * n
            z_ptr += expert * (k // group) * n
            x_rows = rows // TOP_K
        first = pid_k * steps_per_split
        last = tl.minimum(first + steps_per_split, k // BLOCK_K)
        shifts = (tl.arange(0, 8) * 4)[None, :, None]
        # nibble j of a word rotated to float32's mantissa bits 19-22 (bit 4j to bit 19)
        rotations = ((51 - tl.arange(0, 8) * 4) % 32).to(tl.uint32)[None, :, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(first, last):
            k0 = step * BLOCK_K
            words = tl.load(qw_ptr + (k0 // 8 + kw)[:, None].to(tl.int64) * n + cols[None, :],
                            mask=col_ok[None, :], other=0)
            if not WHOLE:
                x = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + (k0 + tl.arange(0, BLOCK_K))[None, :],
                            mask=row_ok[:, None], other=0.0)
            if SUB == 0:  # a 4-bit weight: one group a step
                g = k0 // group
                scale = tl.load(s_ptr + g * n + cols, mask=col_ok, other=0.0).to(tl.float32)
                zero = tl.load(z_ptr + g * n + cols, mask=col_ok, other=0).to(tl.float32)
                if BLOCK_M >= 16 or WHOLE:  # the tile dequantised in registers (for tl.dot)
                    # the nibble under float32's exponent of 2^23 reads as 2^23 + q: one subtraction of 2^23 + zero
                    # gives q - zero exactly, with no integer-to-float conversion (a quarter of the FMA rate)
                    bits = (((words[:, None, :] >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                    w = (tl.reshape(bits, (BLOCK_K, BLOCK_N)) - (zero + 8388608.0)[None, :]) * scale[None, :]
                else:  # CUDA cores: each thread holds whole columns of the tile, so the sum over K stays in it
                    # a nibble rotated under the exponent of 1 reads as v = 1 + q / 16 (a rotation and one mask, no
                    # subtraction): sum x (q - zero) = 16 sum x v - (16 + zero) sum x, the last sum shared by columns
                    wu = words.to(tl.uint32, bitcast=True)[:, None, :]
                    v = (((wu << rotations) | (wu >> (32 - rotations))) & 0x780000) | 0x3F800000
                    v = tl.reshape(v.to(tl.float32, bitcast=True), (BLOCK_K, BLOCK_N))
                    xf = x.to(tl.float32)
                    xv = tl.sum(xf[:, :, None] * v[None, :, :], axis=1)
                    acc += (16.0 * xv - (16.0 + zero)[None, :] * tl.sum(xf, axis=1)[:, None]) * scale[None, :]
            else:  # GGUF planes: a step spans SUBS sub-blocks, each w = a q + b
                nib = tl.reshape((words[:, None, :] >> shifts) & 0xF, (BLOCK_K, BLOCK_N))
                if HIGH > 0:  # the bits above the nibble, 32 / HIGH rows a word
                    PER: tl.constexpr = 32 // HIGH
                    hw = tl.load(h_ptr + (k0 // PER + tl.arange(0, BLOCK_K // PER))[:, None].to(tl.int64) * n
                                 + cols[None, :], mask=col_ok[None, :], other=0)
                    hi = (hw[:, None, :] >> (tl.arange(0, PER) * HIGH)[None, :, None]) & ((1 << HIGH) - 1)
                    nib = nib | (tl.reshape(hi, (BLOCK_K, BLOCK_N)) << 4)
                SUBS: tl.constexpr = BLOCK_K // SUB
                sub = k0 // SUB + tl.arange(0, SUBS)
                at = sub[:, None].to(tl.int64) * n + cols[None, :]
                blk = (sub * SUB // group)[:, None].to(tl.int64) * n + cols[None, :]
                a = tl.load(s_ptr + blk, mask=col_ok[None, :], other=0.0).to(tl.float32)
                if SCALED:
                    a = a * tl.load(sc_ptr + at, mask=col_ok[None, :], other=0).to(tl.float32)
                b = a * (-1.0 * ZERO)
                if MINS > 0:
                    dmin = tl.load(dm_ptr + blk, mask=col_ok[None, :], other=0.0).to(tl.float32)
                    if MINS == 2:
                        dmin = dmin * tl.load(z_ptr + at, mask=col_ok[None, :], other=0).to(tl.float32)
                    b = b - dmin
                q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # under the exponent of 2^23
                if BLOCK_M < 16 and SUBS == 1 and not WHOLE:  # one sub-block: sum x w = a sum x q + b sum x
                    xf = x.to(tl.float32)
                    acc += (tl.sum(xf[:, :, None] * q[None, :, :], axis=1) * tl.reshape(a, (BLOCK_N,))[None, :]
                            + tl.sum(xf, axis=1)[:, None] * tl.reshape(b, (BLOCK_N,))[None, :])
                else:  # each sub-block's affine map spread over its SUB rows
                    a = tl.reshape(tl.broadcast_to(a[:, None, :], (SUBS, SUB, BLOCK_N)), (BLOCK_K, BLOCK_N))
                    b = tl.reshape(tl.broadcast_to(b[:, None, :], (SUBS, SUB, BLOCK_N)), (BLOCK_K, BLOCK_N))
                    w = q * a + b
                    if BLOCK_M < 16 and not WHOLE:
                        acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
            if WHOLE:
                tl.store(y_ptr + (k0 + tl.arange(0, BLOCK_K))[:, None].to(tl.int64) * stride_ym + cols[None, :],
                         w.to(y_ptr.dtype.element_ty), mask=col_ok[None, :])
            elif BLOCK_M >= 16:  # tensor cores
                acc = tl.dot(x, w.to(x.dtype), acc)
        if not WHOLE:
            if WEIGHTED:  # (of each split's partial sum: the sum of the scaled partials is the scaled sum)
                acc = acc * tl.load(rw_ptr + rows, mask=row_ok, other=0.0)[:, None]
            out = rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
            mask = row_ok[:, None] & col_ok[None, :]
            if SPLIT == 1:
                tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)
            else:
                # each split leaves its partial in the workspace; the last to arrive (a counter per tile) adds them
                # in split order (the same sum at every run, eager or graphed), writes y and resets the counter
                tile = pid_m * tl.num_programs(1) + pid_n
                here = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                tl.store(ws_ptr + (tile * SPLIT + pid_k).to(tl.int64) * (BLOCK_M * BLOCK_N) + here, acc)
                tl.debug_barrier()  # every thread's partial is stored before the counter says so
                arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                if arrived == SPLIT - 1:
                    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for part_k in range(SPLIT):
                        total += tl.load(ws_ptr + (tile * SPLIT + part_k).to(tl.int64) * (BLOCK_M * BLOCK_N) + here,
                                         cache_modifier=".cg")
                    tl.store(y_ptr + out, total.to(y_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(cnt_ptr + tile, 0)

    counters: dict = {}  # per device: zeroed int32 counters for split-K tiles, each reset by its last program

    def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
        have = counters.get(device)
        if have is None or have.numel() < tiles:
            have = counters[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        return have

    def run(x: torch.Tensor, weight: Any, scales: Optional[torch.Tensor] = None,
            zeros: Optional[torch.Tensor] = None, config: Optional[W4A16Config] = None,
            out: Optional[torch.Tensor] = None, ids: Optional[torch.Tensor] = None, top_k: int = 1,
            row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids (int32 [P], contiguous): a mixture of experts' (token, expert) pairs on the CUDA cores' kernel,
        qweight/scales/zeros stacked [E, ...]: y [P, N], row p = x[p // top_k] @ W[ids[p]] (times row_weights[p],
        float32 [P], where given)."""
        m, k = x.shape
        blocks = weight if isinstance(weight, BlockPlanes) else None
        pairs = ids is not None
        if blocks is not None:
            fmt, qweight, scales = blocks.fmt, blocks.low, blocks.d
            group, step = fmt.block, max(fmt.sub, 32 // max(fmt.high_bits, 1))  # whole words and sub-blocks
            zeros, high, sub_scales, dmin = (t if t is not None else qweight for t in (blocks.mins, blocks.high,
                                                                                       blocks.scales, blocks.dmin))
            kinds = dict(SUB=fmt.sub, HIGH=fmt.high_bits, ZERO=fmt.zero, SCALED=fmt.scaled, MINS=fmt.mins)
        else:
            qweight, group, step = weight, k // scales.shape[-2], 16
            high = sub_scales = dmin = qweight
            kinds = dict(SUB=0, HIGH=0, ZERO=0, SCALED=False, MINS=0)
        n = qweight.shape[-1]
        c = config or config_for(1 if pairs else m, n, k, math.gcd(k, 256) if blocks is not None else group)
        gemv, whole = 0 < c.block_m < 16, c.block_m == 0
        if blocks is not None and gemv and config is None and step < c.block_k:  # K steps of one sub-block
            c = c._replace(block_k=step, split_k=min(k // step, c.split_k))
        if (qweight.shape[-2] * 8 != k or (blocks is None and group % c.block_k) or k % c.block_k
                or c.block_k % step or (x.stride(1) != 1 and not whole) or (gemv and m > c.block_m and not pairs)
                or (pairs and (blocks is not None or c.block_m != 1 or not ids.is_contiguous()))
                or (out is not None and out.stride(1) != 1)
                or not all(t.is_contiguous() for t in (qweight, scales, zeros, high, sub_scales, dmin))):
            raise ValueError(f"W4A16 GEMM operands: x {tuple(x.shape)} (column stride {x.stride(1)}), weight "
                             f"{tuple(qweight.shape)}, scales {tuple(scales.shape)}, config {tuple(c)}")
        args = (qweight, scales, zeros, high, sub_scales, dmin)
        if whole:  # a large batch: the weight dequantised whole (the kernel storing its tiles), then torch's matmul
            w = torch.empty((k, n), dtype=x.dtype, device=x.device)
            w4a16_gemm_kernel[(1, triton.cdiv(n, c.block_n), k // c.block_k)](
                x, *args, w, w, w, w, w, 0, n, k, group, 1, 0, n, BLOCK_M=1, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                SPLIT=1, TOP_K=0, WEIGHTED=False, WHOLE=True, **kinds, num_warps=c.num_warps,
                num_stages=c.num_stages)
            return x @ w if out is None else out.copy_(x @ w)
        rows = ids.numel() if pairs else m
        steps = k // c.block_k
        per_split = -(-steps // c.split_k)
        split = -(-steps // per_split)
        grid_m = rows if pairs else 1 if gemv else triton.cdiv(m, c.block_m)
        grid_n = triton.cdiv(n, c.block_n)
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device) if out is None else out
        if split > 1:
            ws = torch.empty((grid_m * grid_n * split * c.block_m * c.block_n,), dtype=torch.float32,
                             device=x.device)
            cnt = tile_counters(x.device, grid_m * grid_n)
        else:
            ws = cnt = y
        w4a16_gemm_kernel[(grid_m, grid_n, split)](
            x, *args, y, ws, cnt, ids if pairs else y, row_weights if row_weights is not None else y, rows, n, k,
            group, per_split, x.stride(0), y.stride(0), BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            SPLIT=split, TOP_K=top_k if pairs else 0, WEIGHTED=row_weights is not None, WHOLE=False, **kinds,
            num_warps=c.num_warps, num_stages=c.num_stages)
        return y

    return run
