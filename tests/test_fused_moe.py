"""The mixture-of-experts kernels' CPU side (minisrv/kernels/fused_moe.py, moe_align.py, moe_gemm.py).

References, none of them minisrv's code:
- route: softmax, top-k and renormalisation written out in float64;
- experts_reference: a dense float64 computation, every expert applied to every token and the results masked by
  the routing (out[t] = sum_e m[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t])), m[t, e] the weight of e for t,
  else 0); for FP8, the same with the operands rounded where the reference rounds them (x and the SiLU-and-mul
  output per token, the weights per row; quantize_rows), and without any rounding for the loose bound;
- the alignment: its invariants (helpers/moe_interpreted_checks.py's check_alignment);
- the Triton kernels: Triton's interpreter, in a fresh process (helpers/moe_interpreted_checks.py), against
  float64 on the same operands and against experts_reference. On a GPU: tests/gpu/test_fused_moe.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minisrv.kernels.fp8_quant import quantize_rows
from minisrv.kernels.fused_moe import experts_reference, fused_experts, route
from minisrv.kernels.moe_align import align_reference, max_padded
from minisrv.kernels.moe_gemm import config_for

from .helpers.interpreted import needs_triton, run_checks
from .helpers.moe_interpreted_checks import check_alignment, experts_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H, INTER = 64, 32
BOUNDS = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of the largest output
FP8_LOOSE = 0.2  # FP8 against the unrounded float64 result, of the output's norm: x, the weights and the SiLU
# output each rounded to e4m3 (up to 2^-4 of each value); 5-6% measured on most of these shapes, up to 15% for
# a single token through one expert (few terms to average the roundings out). A misread scale (weight rows are
# spread over a factor of 16) is off by O(1)


def _dense(x, w13, w2, weights, ids, quantise_act: bool = False) -> torch.Tensor:
    """Every expert on every token in float64, masked by the routing; quantise_act: the SiLU-and-mul output
    rounded per token to e4m3 first (quantize_rows)."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    mask = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float64)
    mask.scatter_add_(1, ids.long(), weights.double())
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        g, u = (x @ w13[e].t()).chunk(2, dim=-1)
        act = F.silu(g) * u
        if quantise_act:
            q, s = quantize_rows(act)
            act = q.double() * s.double()
        out += mask[:, e:e + 1] * (act @ w2[e].t())
    return out


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_hand_computation(renormalize, dtype):
    num_experts, top_k = 16, 4
    g = torch.Generator().manual_seed(3)
    # distinct logits, exact in bf16 (quarter steps), so that the top-k has no ties
    logits = torch.stack([torch.randperm(num_experts, generator=g) * 0.25 - 2 for _ in range(7)]).to(dtype)
    weights, ids = route(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (7, top_k)
    for t in range(7):
        z = [float(v) for v in logits[t]]
        p = [2.718281828459045 ** (v - max(z)) for v in z]
        p = [v / sum(p) for v in p]
        best = sorted(range(num_experts), key=lambda e: -p[e])[:top_k]
        expect = [p[e] for e in best]
        if renormalize:
            expect = [v / sum(expect) for v in expect]
        assert ids[t].tolist() == best
        assert torch.allclose(weights[t].double(), torch.tensor(expect, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_experts_reference_matches_dense(dtype, t, num_experts, top_k):
    x, w13, w2, weights, ids = experts_inputs(t, H, INTER, num_experts, top_k, dtype, fp8=False, seed=t + top_k)
    if top_k < num_experts:
        assert not (ids == num_experts - 1).any(), "the last expert must receive no token"
    got = experts_reference(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (t, H)
    err = _relative(got, _dense(x, w13, w2, weights, ids))
    assert err <= BOUNDS[dtype], f"{err:.2e}"


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("t", [1, 5, 33])
def test_fp8_reference_matches_dense(t, num_experts, top_k):
    """float64 x: the reference's arithmetic is float64 too, so against the dense computation with the same
    roundings it agrees to float64 accuracy (an activation on an e4m3 rounding boundary would need agreement to
    the last float32 bit to flip). float32 and bf16 x: against the unrounded result, FP8_LOOSE."""
    x, q13, q2, weights, ids, s13, s2 = experts_inputs(t, H, INTER, num_experts, top_k, torch.float64, fp8=True,
                                                       seed=t + top_k)
    w13, w2 = q13.double() * s13.double()[..., None], q2.double() * s2.double()[..., None]
    xq, xs = quantize_rows(x)
    got = experts_reference(x, q13, q2, weights, ids, s13, s2)
    err = _relative(got, _dense(xq.double() * xs.double(), w13, w2, weights, ids, quantise_act=True))
    assert err <= 1e-12, f"against the same roundings: {err:.2e}"

    unrounded = experts_inputs(t, H, INTER, num_experts, top_k, torch.float64, fp8=False, seed=t + top_k)
    exact = _dense(*unrounded)
    for dtype in (torch.float32, torch.bfloat16):
        got = experts_reference(x.to(dtype), q13, q2, weights, ids, s13, s2)
        assert got.dtype == dtype
        err = ((got.double() - exact).norm() / exact.norm()).item()
        assert err <= FP8_LOOSE, f"{dtype} against the unrounded result: {err:.2e}"


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("t,top_k,num_experts", [(1, 1, 4), (1, 8, 128), (5, 2, 8), (33, 4, 8), (300, 8, 128)])
def test_align_reference_invariants(t, top_k, num_experts, block_m):
    from .helpers.moe_interpreted_checks import routing
    _, ids = routing(t, num_experts, top_k, seed=t)
    aligned = align_reference(ids, num_experts, block_m)
    total = check_alignment(aligned, ids, num_experts, block_m)
    assert total <= max_padded(t * top_k, num_experts, block_m)


def test_max_padded_is_reached_and_never_exceeded():
    """The bound is the padded total of the worst routing (min(n, E) experts hit, the rest on one of them) and
    no routing exceeds it."""
    g = torch.Generator().manual_seed(0)
    for n, num_experts, block_m in [(1, 4, 16), (8, 128, 16), (40, 8, 16), (512, 128, 16), (1000, 8, 64)]:
        m = min(n, num_experts)
        worst = torch.cat([torch.arange(m), torch.zeros(n - m, dtype=torch.long)])
        assert int(align_reference(worst, num_experts, block_m).num_padded) == max_padded(n, num_experts, block_m)
        for _ in range(20):
            ids = torch.randint(0, num_experts, (n,), generator=g)
            assert int(align_reference(ids, num_experts, block_m).num_padded) <= max_padded(n, num_experts, block_m)


def test_launch_rule():
    """16-row blocks while the experts hit get 16 pairs or fewer on average (decode), 64-row blocks beyond, 128-row
    blocks from 128 a expert."""
    for n_pairs, num_experts, block_m in [(8, 128, 16), (512, 128, 16), (2048, 128, 16), (2056, 128, 64),
                                          (64, 8, 16), (136, 8, 64), (16376, 128, 64), (16384, 128, 128)]:
        for fp8 in (False, True):
            c = config_for(n_pairs, num_experts, fp8)
            assert c.block_m == block_m, (n_pairs, num_experts, c)
            assert c.block_k * (1 if fp8 else 2) >= 128  # K steps of 128 bytes or more


def test_fused_experts_on_the_cpu_is_the_reference():
    for fp8 in (False, True):
        args = experts_inputs(9, H, INTER, 8, 2, torch.float32, fp8=fp8, seed=1)
        assert torch.equal(fused_experts(*args), experts_reference(*args))


def test_bad_shapes_are_refused():
    x, w13, w2, weights, ids = experts_inputs(3, H, INTER, 4, 2, torch.float32, fp8=False, seed=1)
    with pytest.raises(ValueError):
        experts_reference(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError):
        experts_reference(x, w13, w2, weights, ids, torch.ones(4, 2 * INTER), torch.ones(4, H))  # not FP8


def test_importing_the_kernels_imports_no_triton():
    code = ("import sys; import minisrv.kernels.fused_moe, minisrv.kernels.moe_align, minisrv.kernels.moe_gemm, "
            "minisrv.kernels.moe_route; "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


@pytest.mark.slow
@needs_triton
def test_moe_triton_kernels_under_the_interpreter():
    out = run_checks("moe_interpreted_checks.py")
    assert out.count("moe align") == 14 and out.count("moe route ") == 11, out
    assert out.count("moe router") == 5, out
    assert out.count("moe grouped GEMMs") == 40 and out.count("moe experts") == 40, out
