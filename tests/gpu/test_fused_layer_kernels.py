"""The layers' fused Triton kernels on a CUDA GPU in bf16: the attention layer's q/k norm + rotary + KV store
(kernels/qk_rope_store.py) against the separate FlashInfer kernels it replaces (the unfused CUDA path) and its
torch reference. End to end (models against HF) these run in test_e2e.py, test_moe.py and test_cuda_graph.py."""
from __future__ import annotations

import pytest
import torch

from minisrv.kernels.qk_rope_store import reference as qk_reference
from minisrv.kernels.qk_rope_store import triton_qk_rope_store
from minisrv.models.layers import RotaryEmbedding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("hq,hkv,d,norm", [(16, 8, 128, True), (32, 4, 128, True), (32, 8, 128, False),
                                           (12, 2, 64, True)])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_qk_rope_store_matches_the_separate_kernels(hq, hkv, d, norm, t):
    flashinfer = pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    torch.manual_seed(t + hq)
    rotary = RotaryEmbedding(d, 4096, 1e6, None).to(dev)
    rotary.reset_buffers(dev)
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(t, width + 64, device=dev, dtype=torch.bfloat16)[:, :width]
    positions = torch.randint(0, 4096, (t,), device=dev)
    qw = (torch.rand(d, device=dev) + 0.5).to(torch.bfloat16) if norm else None
    kw = (torch.rand(d, device=dev) + 0.5).to(torch.bfloat16) if norm else None
    pool = torch.randn(2, 64, 16, hkv, d, device=dev, dtype=torch.bfloat16)
    slots = torch.randperm(1024, device=dev)[:t]

    fused_qkv, fused_pool = qkv.clone(), pool.clone()
    triton_qk_rope_store()(fused_qkv, positions, rotary.cos_sin, hq, hkv, d, qw, kw, 1e-6, fused_pool, slots)

    # the unfused CUDA path: FlashInfer's per-head norms and rotary in place, then the indexed store
    sep_qkv, sep_pool = qkv.clone(), pool.clone()
    q = sep_qkv[:, :hq * d].view(t, hq, d)
    k = sep_qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    if norm:
        flashinfer.rmsnorm(q, qw, 1e-6, out=q)
        flashinfer.rmsnorm(k, kw, 1e-6, out=k)
    flashinfer.apply_rope_with_cos_sin_cache_inplace(positions, sep_qkv[:, :hq * d], sep_qkv[:, hq * d:(hq + hkv) * d],
                                                     d, rotary.cos_sin, True)
    flat = sep_pool.view(2, -1, hkv, d)
    flat[0][slots] = k
    flat[1][slots] = sep_qkv[:, (hq + hkv) * d:].view(t, hkv, d)

    ref_qkv, ref_pool = qkv.clone(), pool.clone()
    qk_reference(ref_qkv, positions, rotary.cos_sin, hq, hkv, d, qw, kw, 1e-6, ref_pool, slots)
    # one bf16 rounding apart at most (2^-8 of a value: the norms' rsqrt and the order of operations differ)
    for got, want in ((fused_qkv, sep_qkv), (fused_pool, sep_pool), (fused_qkv, ref_qkv), (fused_pool, ref_pool)):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2)
    assert (fused_qkv != sep_qkv).float().mean().item() < 0.02  # nearly all equal, not just close

