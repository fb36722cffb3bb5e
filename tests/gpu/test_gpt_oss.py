"""gpt-oss on a CUDA GPU: its experts in the grouped GEMM at gpt-oss-20b's shape (hidden 2880, width 2880, top-4; 16
experts to keep the float64 reference small), in bfloat16 and kept in MXFP4, with biases and the clamped SwiGLU,
against float64 from the specification (helpers/gpt_oss_interpreted_checks.py), eager and replayed from a CUDA
graph; end to end, a tiny gpt-oss (transformers' layout, and MXFP4 experts kept in 4 bits) in bf16 on the backends
that serve sinks (torch; fa where FA3 is installed, also what auto picks on Hopper) against HF transformers in
float64, and fi refused for it."""
from __future__ import annotations


import pytest
import torch

from minisrv import LLM, SamplingParams
from minisrv.attention import BackendUnavailable, device_sm, missing
from minisrv.kernels.fused_moe import fused_experts, fused_runs
from minisrv.kernels.moe_w4a16 import Mxfp4Experts

from ..helpers import build_tiny_model, make_prompts, vocab_of
from .common import assert_float64_hf_greedy, free_cuda, helper_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E, TOP_K, HIDDEN, INTER = 16, 4, 2880, 2880
BOUND = 2e-2  # of the largest output: bfloat16 rounding of the tile and of the activation (2^-9 each)


CHECKS = helper_module("gpt_oss_interpreted_checks")


@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("t", [1, 7, 64, 700])
def test_experts_match_float64(mxfp4, t):
    x, w13, w2, b13, b2, weights, ids = CHECKS.case(t, HIDDEN, INTER, E, TOP_K, mxfp4, True, seed=t)
    ref = CHECKS.experts_float64(x, CHECKS.dense_float64(w13), CHECKS.dense_float64(w2), b13.bfloat16(),
                                 b2.bfloat16(), weights, ids, CHECKS.SWIGLU)
    dev = torch.device("cuda")
    if mxfp4:
        w13, w2 = (Mxfp4Experts(w.blocks.to(dev), w.scales.to(dev)) for w in (w13, w2))
    else:
        w13, w2 = w13.to(dev).bfloat16(), w2.to(dev).bfloat16()
    xb = x.to(dev).bfloat16()
    assert fused_runs(xb, w13, False)
    args = (xb, w13, w2, weights.to(dev), ids.to(dev))
    extra = dict(w13_bias=b13.to(dev).bfloat16(), w2_bias=b2.to(dev).bfloat16(), swiglu=CHECKS.SWIGLU)
    got = fused_experts(*args, **extra)
    err = CHECKS.relative_error(got, ref)
    assert err <= BOUND, f"{'MXFP4' if mxfp4 else 'bf16'} T={t}: error {err:.2e}"
    graph, static = torch.cuda.CUDAGraph(), None
    fused_experts(*args, **extra)  # warm
    with torch.cuda.graph(graph):
        static = fused_experts(*args, **extra)
    graph.replay()
    assert torch.equal(static, got)


@pytest.mark.parametrize("backend,fused_store", [("torch", True), ("auto", True), ("auto", False)])
@pytest.mark.parametrize("mxfp4", [False, True])
def test_tiny_gpt_oss_matches_hf(tmp_path_factory, monkeypatch, mxfp4, backend, fused_store):
    """fused_store False: the layers' own rotary and the backend's K/V store, not the one-kernel rotary + store
    (kernels/qk_rope_store.py), which writes the windowed layers' K/V at the window slots fa names."""
    from ..helpers.gpt_oss_checkpoints import write_mxfp4_pair
    # the SwiGLU limit gpt-oss ships (transformers before 5.18 ignores the config's and uses 7.0; the CPU suite
    # checks a lower one that the products cross). A model that bf16 rounding moves by little, so that the bound
    # is one of rounding: every token takes all four experts (a top-2 choice near a tie flips under rounding, and
    # the token's logits jump with it), and weights of std 0.075, the CPU models' gain per layer at four times their
    # width. A fault still costs whole logits (gate/up read as concatenated halves, or the up's +1 dropped: 1.5-4).
    path = build_tiny_model(str(tmp_path_factory.mktemp("gpt-oss")), "gpt_oss", seed=3, weight_std=0.075,
                            hidden_size=256, head_dim=64, intermediate_size=128, num_experts_per_tok=4,
                            swiglu_limit=7.0)
    ref = path
    if mxfp4:
        root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
        path, ref = write_mxfp4_pair(path, str(root / "mxfp4"), str(root / "twin"))
    with pytest.raises(BackendUnavailable, match="sinks" if missing("fi", device_sm()) is None else "FlashInfer"):
        LLM(model=path, attention_backend="fi", dtype="bfloat16", log_level="warning")
    prompts = make_prompts(vocab_of(path), [40, 90, 9], seed=5)  # past the 8-token window but one
    if not fused_store:
        monkeypatch.setattr("minisrv.models.layer_ops.fused_qk_rope_store", lambda *a: None)
    llm = LLM(model=path, attention_backend=backend, dtype="bfloat16", page_size=1, log_level="warning")
    try:
        fa_here = missing("fa", device_sm(torch.device("cuda"))) is None
        assert llm.engine.runner.backend.name == ("fa" if backend == "auto" and fa_here else "torch")
        experts = llm.engine.runner.model.model.layers[0].mlp.experts
        assert experts.mxfp4 == mxfp4
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        del llm
        free_cuda()
    assert_float64_hf_greedy(ref, prompts, outs, f"{backend}, MXFP4 {mxfp4}, fused store {fused_store}")
