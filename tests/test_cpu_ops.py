"""The CPU layer ops (kernels/cpu_ops.c) against float64 computations of RMSNorm, add + RMSNorm, SiLU-and-mul and
neox rotary, on the layouts the layers hand them: rows of a fused projection's output (strided), per-head views,
and the torch fallbacks for what the kernels do not take (another dtype)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisrv.kernels.cpu_ops import CpuFusedOps
from minisrv.models.layer_ops import fused_ops_for
from minisrv.models.layers import RotaryEmbedding

OPS, HOW = CpuFusedOps.load()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"the CPU ops cannot be built here: {HOW}")


def rms64(x, w, eps):
    h = x.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def test_fused_ops_for_the_cpu_are_these():
    assert isinstance(fused_ops_for(torch.device("cpu")), CpuFusedOps)


def test_rmsnorm_rows_and_heads_of_a_strided_view():
    torch.manual_seed(0)
    x, w = torch.randn(37, 576), torch.randn(576)
    assert (OPS.rmsnorm(x, w, 1e-5).double() - rms64(x, w, 1e-5)).abs().max() < 1e-5
    qkv = torch.randn(5, 12 * 64)  # q heads 0-7 of a qkv output, normed per head in place
    q = qkv[:, :8 * 64].view(5, 8, 64)
    before, wq = q.clone(), torch.randn(64)
    untouched = qkv[:, 8 * 64:].clone()
    OPS.rmsnorm(q, wq, 1e-6, out=q)
    assert (q.double() - rms64(before, wq, 1e-6)).abs().max() < 1e-5
    assert torch.equal(qkv[:, 8 * 64:], untouched)
    xb = x.bfloat16()  # not the kernel's dtype: torch's computation
    assert torch.allclose(OPS.rmsnorm(xb, w, 1e-5).double(), rms64(xb, w, 1e-5), atol=0.1)


def test_add_rmsnorm_in_place():
    torch.manual_seed(1)
    x, res, w = torch.randn(9, 96), torch.randn(9, 96), torch.randn(96)
    total = x.double() + res.double()
    OPS.fused_add_rmsnorm(x, res, w, 1e-5)
    assert (res.double() - total).abs().max() < 1e-6
    assert (x.double() - rms64(total, w, 1e-5)).abs().max() < 1e-5


def test_silu_and_mul():
    torch.manual_seed(2)
    gu = torch.randn(11, 2 * 80) * 6
    g, u = gu.double().chunk(2, dim=-1)
    assert torch.allclose(OPS.silu_and_mul(gu).double(), F.silu(g) * u, rtol=2e-6, atol=1e-6)
    wide = torch.randn(3, 2 * 80 + 8)[:, :160]  # rows farther apart than their width
    g, u = wide.double().chunk(2, dim=-1)
    assert torch.allclose(OPS.silu_and_mul(wide).double(), F.silu(g) * u, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rotary_dim", [64, 48])  # 48: partial rotary, the last 16 dims of each head pass through
def test_rope_in_place_matches_the_layers_rotary(rotary_dim):
    torch.manual_seed(3)
    plain = RotaryEmbedding(64, 512, 10000.0, None, rotary_dim=rotary_dim)
    qkv = torch.randn(6, (9 + 2 * 3) * 64)
    q, k = qkv[:, :9 * 64].view(6, 9, 64), qkv[:, 9 * 64:12 * 64].view(6, 3, 64)
    v_before = qkv[:, 12 * 64:].clone()
    pos = torch.tensor([0, 1, 7, 100, 511, 3])
    cos, sin = plain.cos_sin[pos].double().unsqueeze(1).chunk(2, dim=-1)

    def rot(x):
        x1, x2 = x[..., :rotary_dim].double().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:].double()], dim=-1)

    want_q, want_k = rot(q), rot(k)
    OPS.apply_rope_with_cos_sin_cache_inplace(pos, q.reshape(6, -1), k.reshape(6, -1), 64, plain.cos_sin, True)
    assert (q.double() - want_q).abs().max() < 1e-5 and (k.double() - want_k).abs().max() < 1e-5
    assert torch.equal(qkv[:, 12 * 64:], v_before)
