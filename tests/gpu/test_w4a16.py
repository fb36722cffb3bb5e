"""The W4A16 GEMM (minisrv/kernels/w4a16_gemm.py) and layer (models/w4a16.py) on a CUDA GPU.

The kernel against the float64 product of the dequantised weight (x @ ((q - zero) * scale)), for bfloat16 and
float16 activations, batches 1 to 512 (split-K decode batches and tiled prefill ones), groups of 32, 64 and 128 rows
and one per channel, symmetric and asymmetric zero points, eager and replayed from a CUDA graph (the graph's output
must be the eager one bit for bit: the split-K partial sums are added in a fixed order). The kernel rounds the
dequantised tile to the activations' dtype before the dot and its output once more, so 1e-2 of the largest output
for bfloat16 (2^-8 twice, over sums of thousands of terms), 2e-3 for float16.

The layer on CUDA (activation order, bias) against its CPU path's arithmetic on the same bytes.
"""
from __future__ import annotations

import pytest
import torch

from minisrv.kernels.w4a16_gemm import config_for, dequantize, pack_rows, w4a16_gemm
from minisrv.models.w4a16 import Int4Scheme, Int4Weight, W4A16Linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def random_int4(k: int, n: int, group: int, symmetric: bool, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    groups = k // (group or k)
    values = torch.randint(0, 16, (k, n), device="cuda", generator=g, dtype=torch.uint8)
    scales = (torch.rand(groups, n, device="cuda", generator=g) * 0.01 + 0.001).half()
    zeros = torch.full((groups, n), 8, dtype=torch.uint8, device="cuda") if symmetric else \
        torch.randint(0, 16, (groups, n), device="cuda", generator=g, dtype=torch.uint8)
    return pack_rows(values), scales, zeros


def _error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 64, 128, 0])
@pytest.mark.parametrize("k,n", [(4096, 1536), (2048, 4104)])
def test_kernel_against_float64(k, n, group, dtype):
    run = w4a16_gemm()
    assert run is not None, "Triton is missing"
    for symmetric in (True, False):
        q4 = random_int4(k, n, group, symmetric, seed=k + n + group)
        w = dequantize(*q4, dtype=torch.float64)
        for m in (1, 2, 7, 16, 17, 33, 64, 65, 128, 257, 512):
            x = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m)).to(dtype)
            y = run(x, *q4)
            assert y.shape == (m, n) and y.dtype == dtype
            err = _error(y, x.double() @ w)
            assert err <= BOUND[dtype], (f"m={m} k={k} n={n} group={group} sym={symmetric} {dtype} "
                                         f"{tuple(config_for(m, n, k, group or k))}: {err:.2e}")


@pytest.mark.parametrize("group", [32, 128, 0])
@pytest.mark.parametrize("m", [1, 8, 64, 200, 512])
def test_kernel_in_a_cuda_graph(m, group):
    """Captured once, replayed on new activations written into the captured input: the eager output, bit for bit."""
    run = w4a16_gemm()
    k, n = 4096, 2048
    q4 = random_int4(k, n, group, False, seed=m)
    x = torch.randn(m, k, device="cuda").bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(x, *q4)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = run(x, *q4)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        x.copy_(torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        eager = run(x, *q4)
        assert torch.equal(out, eager), f"m={m} group={group}: the replay differs from the eager run"
        assert _error(out, x.double() @ dequantize(*q4, dtype=torch.float64)) <= BOUND[torch.bfloat16]


@pytest.mark.parametrize("m", [1, 40, 300])
def test_layer_on_cuda_against_its_cpu_path(m):
    """W4A16Linear with an activation order and a bias: the CUDA kernel's output against the CPU path (the same
    dequantised weight in float32, then the product) within bfloat16's error."""
    k, n, group = 2048, 1024, 128
    layer = W4A16Linear(k, n, True, Int4Scheme("gptq", group, False, act_order=True)).cuda()
    qweight, scales, zeros = random_int4(k, n, group, False, seed=3)
    layer.load_rows(0, Int4Weight(qweight, scales, zeros, torch.randperm(k, device="cuda")))
    layer.bias.data = torch.randn(n, device="cuda").bfloat16()  # (the model's dtype, as the loader builds it)
    x = torch.randn(m, k, device="cuda").bfloat16()
    got = layer(x)
    cpu = layer.cpu()
    ref = cpu(x.cpu().float())
    assert got.dtype == torch.bfloat16
    assert _error(got.cpu(), ref.double()) <= BOUND[torch.bfloat16]
