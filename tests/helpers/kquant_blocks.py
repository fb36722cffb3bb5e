"""GGUF's 5-bit and k-quant blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) from ggml's definition (ggml-quants.c's
dequantize_row_* and block structs), apart from minisrv's and gguf's readers: a float64 reading of them, a plain
quantiser that writes valid blocks (min/max scales, not llama.cpp's search: the tests need valid files, not the best
ones), and random blocks (every byte drawn, the float16 scales finite) for bit-exact checks."""
from __future__ import annotations

import numpy as np

BLOCK = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
LEGACY = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}  # random_blocks makes these too


def _half(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float64)[..., 0]


def _scale_min(s: np.ndarray, j: int):
    """get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 scale bytes."""
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4), (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)


def dequantize_f64(raw: np.ndarray, kind: str, rows: int, cols: int) -> np.ndarray:
    """The matrix the blocks hold, computed in float64 (exact: every product is a few bits wide)."""
    per, size = BLOCK[kind]
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, size)
    y = np.zeros((b.shape[0], per), dtype=np.float64)
    if kind in ("Q5_0", "Q5_1"):
        d = _half(b[:, 0:2])
        at = 2 if kind == "Q5_0" else 4
        qh = b[:, at:at + 4].copy().view("<u4")[:, 0].astype(np.int64)
        for j in range(16):
            x0 = (b[:, at + 4 + j] & 0x0F) | (((qh >> j) & 1) << 4)
            x1 = (b[:, at + 4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
            if kind == "Q5_0":
                y[:, j], y[:, j + 16] = (x0 - 16) * d, (x1 - 16) * d
            else:
                m = _half(b[:, 2:4])
                y[:, j], y[:, j + 16] = x0 * d + m, x1 * d + m
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin, sc = _half(b[:, 0:2]), _half(b[:, 2:4]), b[:, 4:16]
        qh, qs = (b[:, 16:48], b[:, 48:176]) if kind == "Q5_K" else (None, b[:, 16:144])
        for j in range(4):  # 64 weights: sub-block 2j from the low nibbles, 2j + 1 from the high
            for half in range(2):
                s, mn = _scale_min(sc, 2 * j + half)
                for ll in range(32):
                    q = (qs[:, 32 * j + ll] >> (4 * half)) & 0xF
                    if qh is not None:
                        q = q | (((qh[:, ll] >> (2 * j + half)) & 1) << 4)
                    y[:, 64 * j + 32 * half + ll] = d * s * q - dmin * mn
    else:  # Q6_K
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _half(b[:, 208:210])
        for n in range(2):
            for ll in range(32):
                is_ = ll // 16
                q1 = ((ql[:, 64 * n + ll] & 0xF) | (((qh[:, 32 * n + ll] >> 0) & 3) << 4)).astype(np.int64) - 32
                q2 = ((ql[:, 64 * n + ll + 32] & 0xF) | (((qh[:, 32 * n + ll] >> 2) & 3) << 4)).astype(np.int64) - 32
                q3 = ((ql[:, 64 * n + ll] >> 4) | (((qh[:, 32 * n + ll] >> 4) & 3) << 4)).astype(np.int64) - 32
                q4 = ((ql[:, 64 * n + ll + 32] >> 4) | (((qh[:, 32 * n + ll] >> 6) & 3) << 4)).astype(np.int64) - 32
                for t, q in enumerate((q1, q2, q3, q4)):
                    y[:, 128 * n + 32 * t + ll] = d * sc[:, 8 * n + is_ + 2 * t] * q
    return y.reshape(rows, cols)


def random_blocks(kind: str, rows: int, cols: int, seed: int, small: bool = False) -> np.ndarray:
    """Random bytes as blocks of `kind`, their float16 scales finite (some subnormal, some zero; `small`: about
    0.01, so that products stay well within float16)."""
    per, size = {**BLOCK, **LEGACY}[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    scales = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208]}[kind]
    for at in scales:
        spread = 0.01 if small else np.exp(rng.uniform(-18, 4, len(b)))
        h = (rng.standard_normal(len(b)) * spread).astype(np.float16)
        h[::17] = 0
        b[:, at:at + 2] = h.view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize(data: np.ndarray, kind: str) -> np.ndarray:
    """A float32 [rows, cols] matrix as blocks of `kind` ([rows, bytes]), min/max scaled."""
    rows, cols = data.shape
    per, size = BLOCK[kind]
    x = data.astype(np.float64).reshape(-1, per)
    out = np.zeros((len(x), size), dtype=np.uint8)
    if kind in ("Q5_0", "Q5_1"):
        lo, hi = x.min(1), x.max(1)
        if kind == "Q5_0":
            amax = np.where(-lo > hi, lo, hi)
            d = _f16(amax / -16).astype(np.float64)
            q = np.clip(np.round(x / np.where(d == 0, 1, d)[:, None]) + 16, 0, 31).astype(np.uint32)
        else:
            d, m = _f16((hi - lo) / 31).astype(np.float64), _f16(lo).astype(np.float64)
            q = np.clip(np.round((x - m[:, None]) / np.where(d == 0, 1, d)[:, None]), 0, 31).astype(np.uint32)
            out[:, 2:4] = _f16(m).view(np.uint8).reshape(-1, 2)
        at = 2 if kind == "Q5_0" else 4
        out[:, 0:2] = _f16(d).view(np.uint8).reshape(-1, 2)
        qh = ((q >> 4) << np.arange(32, dtype=np.uint32)).sum(1).astype("<u4")
        out[:, at:at + 4] = qh.view(np.uint8).reshape(-1, 4)
        out[:, at + 4:at + 20] = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    elif kind in ("Q4_K", "Q5_K"):
        top = 15 if kind == "Q4_K" else 31
        sub = x.reshape(len(x), 8, 32)
        lo = np.minimum(sub.min(2), 0)
        scale, mins = (sub.max(2) - lo) / top, -lo
        d, dmin = _f16(scale.max(1) / 63).astype(np.float64), _f16(mins.max(1) / 63).astype(np.float64)
        sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
        mn = np.clip(np.round(mins / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
        step = np.where(sc == 0, 1, d[:, None] * sc)
        q = np.clip(np.round((sub + (dmin[:, None] * mn)[..., None]) / step[..., None]), 0, top).astype(np.uint8)
        out[:, 0:2] = _f16(d).view(np.uint8).reshape(-1, 2)
        out[:, 2:4] = _f16(dmin).view(np.uint8).reshape(-1, 2)
        for j in range(4):
            out[:, 4 + j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
            out[:, 8 + j] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
            out[:, 12 + j] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
        qs = 16 if kind == "Q4_K" else 48
        for j in range(4):
            out[:, qs + 32 * j:qs + 32 * j + 32] = (q[:, 2 * j] & 0xF) | ((q[:, 2 * j + 1] & 0xF) << 4)
        if kind == "Q5_K":
            out[:, 16:48] = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
    else:  # Q6_K
        sub = x.reshape(len(x), 16, 16)
        scale = np.abs(sub).max(2) / 31
        d = _f16(scale.max(1) / 127).astype(np.float64)
        sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
        step = np.where(sc == 0, 1, d[:, None] * sc)
        q = (np.clip(np.round(sub / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(len(x), 2, 128)
        for n in range(2):
            out[:, 64 * n:64 * n + 64] = (q[:, n, :64] & 0xF) | ((q[:, n, 64:] & 0xF) << 4)
            hi = q[:, n] >> 4
            out[:, 128 + 32 * n:160 + 32 * n] = (hi[:, :32] | (hi[:, 32:64] << 2) | (hi[:, 64:96] << 4)
                                                 | (hi[:, 96:] << 6))
        out[:, 192:208] = sc.view(np.uint8)
        out[:, 208:210] = _f16(d).view(np.uint8).reshape(-1, 2)
    return out.reshape(rows, -1)
