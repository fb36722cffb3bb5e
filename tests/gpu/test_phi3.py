"""Phi-4-mini's rotary on a CUDA GPU: LongRoPE over 0.75 of each head goes through FlashInfer's rotary (which turns
the cache's width of each head), not the fused Triton q/k rotary + store (which turns whole heads); end to end, a
tiny random Phi-4-mini-shaped checkpoint in bf16 per backend against HF transformers in float64."""
from __future__ import annotations

import pytest
import torch

from minisrv import LLM, SamplingParams
from minisrv.kernels.qk_rope_store import fused_qk_rope_store
from minisrv.models.layer_ops import LayerOps
from minisrv.models.layers import RotaryEmbedding

from ..helpers import build_tiny_model, make_prompts, vocab_of
from .common import assert_float64_hf_greedy, free_cuda, skip_unless_runs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

def _longrope(head_dim: int, rotary_dim: int, dev: torch.device) -> RotaryEmbedding:
    factors = torch.linspace(1.0, 8.0, rotary_dim // 2).tolist()
    scaling = dict(rope_type="longrope", short_factor=factors, long_factor=factors, factor=32.0,
                   original_max_position_embeddings=128)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, scaling, rotary_dim=rotary_dim)
    rotary.reset_buffers(dev)
    return rotary


@pytest.mark.parametrize("rotary_dim", [96, 128])
def test_flashinfer_rotary_of_part_of_each_head_matches_torch(rotary_dim):
    flashinfer = pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    torch.manual_seed(rotary_dim)
    rotary = _longrope(128, rotary_dim, dev)
    q = torch.randn(37, 24, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(37, 8, 128, device=dev, dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (37,), device=dev)
    want_q, want_k = LayerOps(None).rope(positions, q.clone(), k.clone(), rotary.cos_sin)
    got_q, got_k = LayerOps(flashinfer).rope(positions, q.clone(), k.clone(), rotary.cos_sin)
    torch.testing.assert_close(got_q, want_q, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(got_k, want_k, rtol=1.6e-2, atol=1.6e-2)
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])  # the rest of each head passes through


def test_the_fused_rotary_and_store_is_not_taken_for_a_partial_rotary():
    dev = torch.device("cuda")
    qkv = torch.zeros(2, 40 * 128, device=dev, dtype=torch.bfloat16)
    assert fused_qk_rope_store(qkv, _longrope(128, 96, dev).cos_sin, 128) is None
    full = fused_qk_rope_store(qkv, _longrope(128, 128, dev).cos_sin, 128)
    assert full is None or callable(full)  # (None only where Triton is missing)


@pytest.mark.parametrize("backend", ["fa", "fi", "torch"])
def test_phi4_mini_shaped_greedy_matches_hf(tmp_path_factory, backend):
    skip_unless_runs(backend)
    path = str(tmp_path_factory.mktemp("phi4-mini"))
    # heads of 128 (the attention kernels' size), 96 of them turned: 48 factors of each set
    factors = torch.linspace(1.0, 6.0, 48).tolist()
    build_tiny_model(path, "phi4_mini", seed=3, hidden_size=512, head_dim=128,
                     rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=factors[::-1],
                                          long_factor=factors))
    prompts = make_prompts(vocab_of(path), [40, 90, 33], seed=5)  # past the original 32 positions
    llm = LLM(model=path, attention_backend=backend, dtype="bfloat16", page_size=1, log_level="warning")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        del llm
        free_cuda()
    assert_float64_hf_greedy(path, prompts, outs, backend)
