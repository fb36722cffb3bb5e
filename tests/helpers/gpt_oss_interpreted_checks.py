"""gpt-oss's experts in the grouped GEMM (minisrv/kernels/moe_gemm.py: the BIAS and CLAMP epilogue, the MXFP4 weight
tile; driven by fused_moe.triton_experts) run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before
Triton is imported: hence a script of its own, run by tests/test_gpt_oss.py in a fresh process). Also imported by
tests/gpu/test_gpt_oss.py for its operands and reference (importing it does not switch the interpreter on).

Checked against a float64 computation from the specification: W from the MXFP4 bytes decoded bit by bit (sign,
two exponent bits, one mantissa bit; 2^(s - 127) per 32 values), out = sum_j w_j * (down_e(act(gate_e(x) + b_g,
up_e(x) + b_u)) + b_d) with act the clamped SwiGLU or SiLU-and-mul. Weights in float16 (the interpreter's bfloat16
products are not the GPU's) or MXFP4, with and without biases; the three launch configurations, and a decode step's
few MXFP4 pairs on their own kernel (kernels/mxfp4_pairs.py); widths whose K steps halve (96) or end short, and
partial column tiles. Prints one line per check and "ok" at the end."""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minisrv.kernels.moe_gemm import ClampedSwiGLU  # noqa: E402
from minisrv.kernels.moe_w4a16 import Mxfp4Experts  # noqa: E402

BOUND = 3e-3  # of the largest output (float16 rounding of the activation and, for float16 weights, of W)
SWIGLU = ClampedSwiGLU(1.702, 0.6)  # a limit the random products cross, so the clamps are exercised


def e2m1_float64(q: torch.Tensor) -> torch.Tensor:
    """The OCP e2m1 value of each nibble, from its bits."""
    sign = 1 - 2 * ((q >> 3) & 1).double()
    exp, mant = ((q >> 1) & 3).double(), (q & 1).double()
    return sign * torch.where(exp == 0, mant * 0.5, 2 ** (exp - 1) * (1 + mant / 2))


def mxfp4_float64(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bytes [..., N, K/2], exponents [..., N, K/32] -> W [..., N, K] float64 (the even k in the low nibble)."""
    b = blocks.long()
    w = torch.stack([e2m1_float64(b & 0xF), e2m1_float64(b >> 4)], dim=-1).flatten(-2)
    return (w.unflatten(-1, (scales.shape[-1], 32)) * 2.0 ** (scales.double() - 127)[..., None]).flatten(-2)


def random_mxfp4(num_experts: int, n: int, k: int, gen: torch.Generator) -> Mxfp4Experts:
    """Random bytes, and exponents around 2^-4 spread over [2^-3, 2^-6] (a scale read for the wrong 32 is off)."""
    blocks = torch.randint(0, 256, (num_experts, n, k // 2), generator=gen, dtype=torch.uint8)
    return Mxfp4Experts(blocks, torch.randint(121, 125, (num_experts, n, k // 32), generator=gen, dtype=torch.uint8))


def experts_float64(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor],
                    b2: Optional[torch.Tensor], weights: torch.Tensor, ids: torch.Tensor,
                    swiglu: Optional[ClampedSwiGLU]) -> torch.Tensor:
    """w13 [E, 2I, H] and w2 [E, H, I] float64 (gate rows, then up rows)."""
    t, top_k = ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float64)
    for token in range(t):
        for j in range(top_k):
            e = int(ids[token, j])
            gu = w13[e] @ x[token].double() + (b13[e].double() if b13 is not None else 0)
            g, u = gu.chunk(2)
            if swiglu is not None:
                g, u = g.clamp(max=swiglu.limit), u.clamp(-swiglu.limit, swiglu.limit)
                act = g / (1 + torch.exp(-swiglu.alpha * g)) * (u + 1)
            else:
                act = g / (1 + torch.exp(-g)) * u
            out[token] += float(weights[token, j]) * (w2[e] @ act + (b2[e].double() if b2 is not None else 0))
    return out


def case(t: int, h: int, inter: int, num_experts: int, top_k: int, mxfp4: bool, bias: bool, seed: int
         ) -> Tuple[torch.Tensor, object, object, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor,
                    torch.Tensor]:
    """x [t, h] float32, w13 and w2 (float16 stacks or Mxfp4Experts), biases (float32 or None), a top-k routing."""
    gen = torch.Generator().manual_seed(seed)
    if mxfp4:
        w13, w2 = random_mxfp4(num_experts, 2 * inter, h, gen), random_mxfp4(num_experts, h, inter, gen)
    else:
        w13 = (torch.randn(num_experts, 2 * inter, h, generator=gen) * h ** -0.5).half()
        w2 = (torch.randn(num_experts, h, inter, generator=gen) * inter ** -0.5).half()
    b13 = torch.randn(num_experts, 2 * inter, generator=gen) * 0.3 if bias else None
    b2 = torch.randn(num_experts, h, generator=gen) * 0.3 if bias else None
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(t)]).int()
    weights = torch.softmax(torch.randn(t, top_k, generator=gen), -1)
    return x, w13, w2, b13, b2, weights, ids


def dense_float64(w: object) -> torch.Tensor:
    return mxfp4_float64(w.blocks, w.scales) if isinstance(w, Mxfp4Experts) else w.double()


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


def check(t: int, h: int, inter: int, num_experts: int, top_k: int, mxfp4: bool, bias: bool, swiglu: bool,
          n_pairs_rule: Optional[int] = None, by_pair: bool = False) -> None:
    """by_pair: no launch configuration given, so that a decode step's few MXFP4 pairs take kernels/mxfp4_pairs.py"""
    from minisrv.kernels.fused_moe import PAIR_ROWS, experts_reference, launch_config, triton_experts
    x, w13, w2, b13, b2, weights, ids = case(t, h, inter, num_experts, top_k, mxfp4, bias, seed=t * 7 + h + inter)
    act = SWIGLU if swiglu else None
    assert not by_pair or (mxfp4 and t * top_k <= PAIR_ROWS)
    c = None if by_pair else launch_config(n_pairs_rule or t * top_k, w13, False)
    half = (lambda b: b.half() if b is not None else None)
    got = triton_experts(x.half(), w13, w2, weights, ids, config=c, w13_bias=half(b13), w2_bias=half(b2),
                         swiglu=act)
    ref = experts_float64(x, dense_float64(w13), dense_float64(w2), half(b13), half(b2), weights, ids, act)
    err = relative_error(got, ref)
    what = f"{'MXFP4' if mxfp4 else 'float16'} H={h} I={inter} T={t} k={top_k} bias={bias} swiglu={swiglu} " \
        f"{'pairs' if by_pair else tuple(c)}"
    assert got.dtype == torch.float16 and got.shape == (t, h), (got.dtype, got.shape)
    assert err <= BOUND, f"{what}: error {err:.2e}"
    if mxfp4:  # the torch path (the CPU's) on the same operands, in float64: the same numbers
        cpu = experts_reference(x.double(), w13, w2, weights, ids, w13_bias=half(b13), w2_bias=half(b2), swiglu=act)
        assert relative_error(cpu, ref) <= 1e-12, what
    print(f"{what}: error {err:.1e} of the largest output")


def main() -> None:
    from minisrv.kernels.moe_gemm import moe_gemm
    assert moe_gemm() is not None, "Triton is missing"
    start = time.time()
    for mxfp4 in (False, True):
        for bias, swiglu in ((True, True), (False, False), (True, False)):
            check(3, 128, 64, 8, 2, mxfp4, bias, swiglu)  # decode blocks (16 rows, 64 columns)
        check(40, 128, 64, 4, 2, mxfp4, True, True, n_pairs_rule=256)  # prefill blocks (64 rows, 128 columns)
        check(9, 96, 96, 4, 4, mxfp4, True, True, n_pairs_rule=2048)  # large blocks; K steps of 32; partial tiles
    for bias, swiglu in ((True, True), (False, False)):
        check(3, 1088, 128, 8, 2, True, bias, swiglu, by_pair=True)  # decode pairs: K steps of 512, the last short
    check(2, 96, 96, 4, 4, True, True, True, by_pair=True)  # one K step cut short
    print(f"({time.time() - start:.0f} s)")
    print("ok")


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' factories import Triton
    main()
