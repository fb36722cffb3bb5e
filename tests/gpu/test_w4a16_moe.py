"""The 4-bit experts (minisrv/kernels/moe_gemm.py's INT4 path and w4a16_gemm.py's decode pairs, through
fused_moe.fused_experts) on a CUDA GPU, at Qwen3-30B-A3B's expert shape (hidden 2048, width 768, top-8; 64 experts to
keep the float64 reference small).

Against dequantise-then-per-expert-matmul in float64 (helpers/moe_w4a16_interpreted_checks.py's RandomExperts: W =
(q - zero) * scale from the drawn values, activation order applied per expert): batches of 1 to 512 tokens (all
three launch configurations, one- and three-launch alignment), groups of 32, 64, 128 rows and one per channel,
symmetric and asymmetric zero points, activation order, bfloat16 and float16 activations. The kernel rounds the
dequantised tile and the SiLU-and-mul output to the activations' dtype: 2e-2 of the largest output for bfloat16
(2^-9 each), 3e-3 for float16. Then the model's path (the router's one-launch alignment, then the experts) captured
in a CUDA graph and replayed on new inputs: the eager result, bit for bit, within the same bound of float64.
"""
from __future__ import annotations

import functools

import pytest
import torch

from minisrv.kernels.fused_moe import fused_experts, fused_runs, route, route_and_align

from .common import helper_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E, TOP_K, HIDDEN, INTER = 64, 8, 2048, 768
BOUND = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


CHECKS = helper_module("moe_w4a16_interpreted_checks")


@functools.lru_cache(maxsize=2)
def _experts(group: int, symmetric: bool, act_order: bool):
    """(w13, w2) RandomExperts on the GPU, and their PackedExperts."""
    gen = torch.Generator().manual_seed(group + 2 * symmetric + act_order)
    w13 = CHECKS.RandomExperts(E, HIDDEN, 2 * INTER, group, symmetric, act_order, gen, torch.float16, "cuda")
    w2 = CHECKS.RandomExperts(E, INTER, HIDDEN, group, symmetric, act_order, gen, torch.float16, "cuda")
    return w13, w2, w13.packed(), w2.packed()


def _float64(x, w13, w2, weights, ids) -> torch.Tensor:
    """The experts in float64: each expert hit dequantised, its pairs' rows multiplied, summed by routing weight."""
    t, k = ids.shape
    flat, tokens = ids.reshape(-1).long(), torch.arange(t * k, device=x.device) // k
    out = torch.zeros(t, x.shape[1], dtype=torch.float64, device=x.device)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]
        g, u = w13.product(x[tokens[pairs]].double(), e).chunk(2, dim=-1)
        y = w2.product(g / (1 + torch.exp(-g)) * u, e) * weights.reshape(-1)[pairs, None].double()
        out.index_add_(0, tokens[pairs], y)
    return out


def _inputs(t: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, HIDDEN, device="cuda", generator=g).to(dtype)
    return x, torch.randn(t, E, device="cuda", generator=g)


def _error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("group,symmetric,act_order,dtype", [
    (128, True, False, torch.bfloat16), (128, False, False, torch.float16), (64, False, False, torch.bfloat16),
    (32, True, False, torch.bfloat16), (0, False, False, torch.bfloat16), (128, True, True, torch.bfloat16)])
def test_against_float64(group, symmetric, act_order, dtype):
    w13, w2, p13, p2 = _experts(group, symmetric, act_order)
    for t in (1, 2, 7, 16, 33, 64, 200, 512):
        x, logits = _inputs(t, dtype, seed=t)
        weights, ids = route(logits, TOP_K, True)
        assert fused_runs(x, p13, False), "the fused 4-bit path does not run here"
        got = fused_experts(x, p13, p2, weights, ids)
        assert got.dtype == dtype and got.shape == (t, HIDDEN)
        err = _error(got, _float64(x, w13, w2, weights, ids))
        assert err <= BOUND[dtype], f"T={t} group={group} sym={symmetric} act_order={act_order} {dtype}: {err:.2e}"


@pytest.mark.parametrize("group", [32, 128, 0])
@pytest.mark.parametrize("t", [1, 16, 64, 256])
def test_cuda_graph_replay(t, group):
    """The model's path (route_and_align where it runs, else route; then the experts) captured once and replayed
    on new tokens and router weights copied into the captured inputs: the eager output bit for bit."""
    w13, w2, p13, p2 = _experts(group, True, False)
    x, _ = _inputs(t, torch.bfloat16, seed=t)
    router = (torch.randn(E, HIDDEN, device="cuda") * HIDDEN ** -0.5).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def step():
        routed = route_and_align(x, router, counter, TOP_K, True, p13, False)
        weights, ids, aligned = routed if routed is not None else (*route(x @ router.t(), TOP_K, True), None)
        return fused_experts(x, p13, p2, weights, ids, aligned=aligned), weights, ids

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, weights, ids = step()
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        new_x, _ = _inputs(t, torch.bfloat16, seed=100 + seed)
        x.copy_(new_x)
        router.copy_(torch.randn_like(router, dtype=torch.float32).bfloat16() * HIDDEN ** -0.5)
        graph.replay()
        torch.cuda.synchronize()
        eager, eager_weights, eager_ids = step()
        assert torch.equal(ids, eager_ids) and torch.equal(out, eager), f"T={t} group={group} replay {seed}"
        assert _error(out, _float64(x, w13, w2, weights, ids)) <= BOUND[torch.bfloat16]
