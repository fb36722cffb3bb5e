"""The fused experts (minisrv/kernels/fused_moe.py's fused_experts: the Triton alignment and grouped GEMMs) on a
CUDA GPU, against experts_reference on the same GPU and operands.

Tolerances: bf16, BF16_BOUND of the largest output: both round the products to bf16 (2^-9 of each value), the
reference also gate/up before SiLU-and-mul and the down product before the routing weight, and they sum in
different orders. FP8, FP8_NORM_BOUND of the output's norm: the kernel computes SiLU-and-mul from float32 and
rounds once, the reference from gate/up rounded to bf16 (Fp8Linear's path), so some activations are rounded to
the neighbouring e4m3 value (2^-4 to 2^-3 apart) before the down product.
"""
from __future__ import annotations

import functools

import pytest
import torch

from minisrv.kernels.fp8_quant import quantize_rows
from minisrv.kernels.fused_moe import experts_reference, fused_experts, fused_runs, route, route_and_align
from minisrv.kernels.moe_align import align_reference, triton_align
from minisrv.kernels.moe_gemm import config_for

from .common import helper_module


_CHECKS = helper_module("moe_interpreted_checks")
check_alignment, assert_same_alignment = _CHECKS.check_alignment, _CHECKS.assert_same_alignment
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_BOUND = 2e-2
FP8_NORM_BOUND = 4e-2


@functools.lru_cache(maxsize=4)
def _experts(num_experts: int, hidden: int, inter: int, fp8: bool):
    """(w13, w2, w13_scale, w2_scale) on the GPU: bf16 weights (rows of random scale), or their per-row FP8."""
    g = torch.Generator(device="cuda").manual_seed(num_experts + hidden)

    def rows(*shape):
        spread = 4 ** (2 * torch.rand(*shape[:-1], 1, device="cuda", generator=g) - 1)
        return (torch.randn(*shape, device="cuda", generator=g) * shape[-1] ** -0.5 * spread).bfloat16()
    w13, w2 = rows(num_experts, 2 * inter, hidden), rows(num_experts, hidden, inter)
    if not fp8:
        return w13, w2, None, None
    q13, s13 = quantize_rows(w13.reshape(-1, hidden))
    q2, s2 = quantize_rows(w2.reshape(-1, inter))
    return (q13.view(num_experts, 2 * inter, hidden), q2.view(num_experts, hidden, inter),
            s13.view(num_experts, 2 * inter), s2.view(num_experts, hidden))


def _inputs(t: int, num_experts: int, top_k: int, hidden: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, hidden, device="cuda", generator=g).bfloat16()
    logits = torch.randn(t, num_experts, device="cuda", generator=g).bfloat16()
    return x, logits


def _errors(got: torch.Tensor, ref: torch.Tensor):
    d, r = got.double() - ref.double(), ref.double()
    return (d.abs().max() / r.abs().max()).item(), (d.norm() / r.norm()).item()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("hidden,inter", [(512, 256), (1024, 768)])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (128, 2), (8, 8)])
@pytest.mark.parametrize("t", [1, 2, 7, 16, 64, 128, 512])
def test_fused_matches_reference(t, num_experts, top_k, hidden, inter, fp8):
    w13, w2, s13, s2 = _experts(num_experts, hidden, inter, fp8)
    x, logits = _inputs(t, num_experts, top_k, hidden, seed=t)
    weights, ids = route(logits, top_k, renormalize=True)
    assert fused_runs(x, w13, fp8), "the fused path does not run here"
    got = fused_experts(x, w13, w2, weights, ids, s13, s2)
    ref = experts_reference(x, w13, w2, weights, ids, s13, s2)
    assert got.dtype == torch.bfloat16 and got.shape == (t, hidden)
    worst, norm = _errors(got, ref)
    if fp8:
        assert norm <= FP8_NORM_BOUND, f"{norm:.2e} of the norm (max {worst:.2e})"
    else:
        assert worst <= BF16_BOUND, f"{worst:.2e} of the largest output (norm {norm:.2e})"


@pytest.mark.parametrize("n_pairs,num_experts", [(1, 8), (8, 128), (100, 128), (512, 128), (2048, 128), (5000, 8),
                                                 (65536, 128)])
@pytest.mark.parametrize("block_m", [16, 64, 128])
@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "three-launches"])
def test_align_kernel_invariants(n_pairs, num_experts, block_m, one_launch):
    """The alignment on the GPU, in one launch and in three, up to 8,192 tokens of top-8 (many CHUNK steps): its
    invariants, its padded total as the torch alignment's; the one launch's whole output as the torch one's (both
    keep pairs in index order within a group)."""
    ids = torch.randint(0, num_experts - 1, (n_pairs, 1), device="cuda", dtype=torch.int32)
    aligned = triton_align()(ids, num_experts, block_m, one_launch)
    total = check_alignment(aligned, ids, num_experts, block_m)
    ref = align_reference(ids, num_experts, block_m)
    assert total == int(ref.num_padded)
    if one_launch:
        assert_same_alignment(aligned, ref)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 16, 64])
def test_cuda_graph_replay(t, fp8):
    """route + fused_experts captured once, replayed on new inputs copied into the static buffers."""
    num_experts, top_k, hidden, inter = 128, 8, 1024, 768
    w13, w2, s13, s2 = _experts(num_experts, hidden, inter, fp8)
    x, logits = _inputs(t, num_experts, top_k, hidden, seed=100 + t)

    def step():
        weights, ids = route(logits, top_k, renormalize=True)
        return fused_experts(x, w13, w2, weights, ids, s13, s2)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2, 3):
        new_x, new_logits = _inputs(t, num_experts, top_k, hidden, seed=200 + seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        weights, ids = route(new_logits, top_k, renormalize=True)
        ref = experts_reference(new_x, w13, w2, weights, ids, s13, s2)
        worst, norm = _errors(out, ref)
        assert (norm <= FP8_NORM_BOUND) if fp8 else (worst <= BF16_BOUND), f"replay {seed}: {worst:.2e}, {norm:.2e}"


@pytest.mark.parametrize("t", [1, 7, 64, 512])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_kernel_matches_torch_on_the_cpu(t, num_experts, top_k, renormalize):
    """route on CUDA (the one-launch Triton top-k) against route on the CPU (torch's topk and softmax) for the same
    bf16 logits, made distinct (a permutation in steps of 1/16, exact in bf16) so the top-k has one answer."""
    g = torch.Generator().manual_seed(t + num_experts)
    logits = torch.stack([torch.randperm(num_experts, generator=g) / 16.0 - 2 for _ in range(t)]).bfloat16()
    weights, ids = route(logits.cuda(), top_k, renormalize)
    ref_w, ref_ids = route(logits, top_k, renormalize)
    assert torch.equal(ids.cpu(), ref_ids)
    assert torch.allclose(weights.cpu(), ref_w, rtol=1e-5, atol=1e-7)


def _router_inputs(t: int, num_experts: int, hidden: int, seed: int):
    """(x [t, hidden], router weight [E, hidden], logits float64 [t, E]) with x @ w^T exact in any summation order:
    w a permuted identity over x's first E columns (distinct logits, a permutation in steps of 1/16, exact in bf16)
    and zeros against random values in the others, so every K piece and expert tile of the product takes part."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.stack([torch.randperm(num_experts, generator=g) / 16.0 - 2 for _ in range(t)]).double()
    perm = torch.randperm(num_experts, generator=g)
    x = torch.cat([logits[:, perm].float(), torch.randn(t, hidden - num_experts, generator=g)], dim=1)
    w = torch.zeros(num_experts, hidden)
    w[perm, torch.arange(num_experts)] = 1.0
    return x.bfloat16().cuda(), w.bfloat16().cuda(), logits


@pytest.mark.parametrize("t", [1, 2, 7, 16])
@pytest.mark.parametrize("num_experts,top_k,hidden", [(8, 2, 4096), (60, 4, 2048), (128, 8, 2048), (128, 8, 1000)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_in_one_launch_matches_route_and_align(t, num_experts, top_k, hidden, renormalize):
    """route_and_align (the router's product, top-k and alignment in one launch) against route() of the same logits
    and the torch alignment of its ids; fifty calls in a row on one counter (each leaves it zero)."""
    x, w, logits = _router_inputs(t, num_experts, hidden, seed=t + num_experts)
    w13 = torch.empty(num_experts, 2, 16, dtype=torch.bfloat16, device="cuda")  # only its shape and dtype are read
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    ref_w, ref_ids = route(logits.cpu(), top_k, renormalize)
    for _ in range(50):
        weights, ids, aligned = route_and_align(x, w, counter, top_k, renormalize, w13, False)
    assert torch.equal(ids.cpu(), ref_ids)
    assert torch.allclose(weights.cpu(), ref_w, rtol=1e-5, atol=1e-7)
    assert_same_alignment(aligned, align_reference(ids, num_experts, config_for(t * top_k, num_experts, False).block_m))
    assert int(counter) == 0


@pytest.mark.parametrize("t", [1, 5, 16])
def test_router_with_a_bias_matches_the_linear_layer(t):
    """gpt-oss's router has a bias: route_and_align with it against route() of F.linear(x, w, bias) (the model's
    product, rounded once to bf16 as the kernel rounds its sum) at gpt-oss-20b's shape."""
    num_experts, top_k, hidden = 32, 4, 2880
    x, w, _ = _router_inputs(t, num_experts, hidden, seed=t)
    bias = (torch.randn(num_experts, generator=torch.Generator().manual_seed(t)) * 0.5).bfloat16().cuda()
    w13 = torch.empty(num_experts, 2, 16, dtype=torch.bfloat16, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    weights, ids, aligned = route_and_align(x, w, counter, top_k, True, w13, False, bias)
    ref_w, ref_ids = route(torch.nn.functional.linear(x, w, bias), top_k, True)
    assert torch.equal(ids, ref_ids) and torch.allclose(weights, ref_w, rtol=1e-5, atol=1e-7)
    assert not torch.equal(ids, route(x @ w.T, top_k, True)[1]) or t == 1  # the bias moved some choice
    assert_same_alignment(aligned, align_reference(ids, num_experts, config_for(t * top_k, num_experts, False).block_m))


@pytest.mark.parametrize("t", [1, 16])
def test_router_in_one_launch_under_graph_replay(t):
    """route_and_align captured once and replayed on new inputs: as its eager result each time."""
    num_experts, top_k, hidden = 128, 8, 2048
    x, w, _ = _router_inputs(t, num_experts, hidden, seed=1)
    w13 = torch.empty(num_experts, 2, 16, dtype=torch.bfloat16, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        route_and_align(x, w, counter, top_k, True, w13, False)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = route_and_align(x, w, counter, top_k, True, w13, False)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (2, 3, 4):
        new_x, _, _ = _router_inputs(t, num_experts, hidden, seed=seed)
        x.copy_(new_x)
        graph.replay()
        ref_w, ref_ids, ref_aligned = route_and_align(new_x, w, torch.zeros_like(counter), top_k, True, w13, False)
        torch.cuda.synchronize()
        assert torch.equal(out[1], ref_ids) and torch.equal(out[0], ref_w)
        assert_same_alignment(out[2], ref_aligned)
        assert int(counter) == 0
