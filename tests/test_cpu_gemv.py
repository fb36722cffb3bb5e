"""The CPU's small-batch projection kernel (kernels/cpu_gemv.c) against float64: row counts across its range,
widths that are and are not multiples of its 8-row blocks, strided rows of x, bias; what it declines goes to torch;
and a model built on the CPU holds its projections as CpuLinear layers that give F.linear's result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisrv.kernels.cpu_gemv import MAX_ROWS, SmallBatchLinear, linear
from minisrv.models.layer_ops import LayerOps, fused_ops_for
from minisrv.models.layers import CpuLinear


@pytest.fixture(scope="module")
def small():
    kernel, how = SmallBatchLinear.load()
    if kernel is None:
        pytest.skip(f"the CPU kernels do not build here: {how}")
    return kernel


@pytest.mark.parametrize("m", [1, 2, 3, 8, 17, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(8, 64), (13, 100), (960, 576), (3, 1536)])
def test_small_batch_projection_matches_float64(small, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    base = torch.randn(m, k + 5, generator=g)
    x = base[:, 2:2 + k]  # rows k + 5 floats apart
    bias = torch.randn(n, generator=g)
    assert small.takes(x, w)
    ref = x.double() @ w.double().t() + bias.double()
    out = small(x, w, bias)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert (out.double() - ref).abs().max() <= 1e-5 * (x.double().abs() @ w.double().abs().t()).max()


def test_what_the_kernel_declines_goes_to_torch(small):
    w = torch.randn(16, 32)
    for x in (torch.randn(MAX_ROWS + 1, 32), torch.randn(4, 32).double(), torch.randn(2, 3, 32),
              torch.randn(32, 4).t()):
        assert not small.takes(x, w.to(x.dtype))
        assert torch.equal(linear(x, w.to(x.dtype), None, small), F.linear(x, w.to(x.dtype)))


def test_cpu_model_projections_are_cpu_linear(small):
    fused = fused_ops_for(torch.device("cpu"))
    if fused is None or fused.small_batch_linear is None:
        pytest.skip("no compiled CPU ops here")
    from minisrv.models.layers import make_linear
    layer = make_linear(64, 24, True, None, LayerOps(fused))
    assert isinstance(layer, CpuLinear)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 64)
    assert not small.takes(x, layer.weight)  # a gradient could be wanted: torch's path, which has a backward
    with torch.no_grad():  # as the engine runs
        for rows in (1, 5, MAX_ROWS, MAX_ROWS + 9):  # the kernel, then torch past its rows
            x = torch.randn(rows, 64)
            assert small.takes(x, layer.weight) == (rows <= MAX_ROWS)
            assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
