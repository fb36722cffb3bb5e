"""Mixtures of experts against HF transformers (float64, eager experts) on tiny random checkpoints: Qwen3-MoE (8
experts top-2 with a dense layer among the sparse ones; 4 experts top-4 without renormalising, every second layer
sparse), Mixtral (4 experts top-2, its block_sparse_moe/w1-w3 names) and Qwen2-MoE (a shared expert behind a sigmoid
gate). Greedy tokens and every logits row under plain batching, one request alone, chunked prefill, retraction and
the prefix cache; the same model from a GGUF file written from it; FP8 experts; prompt logprobs, grammars and the FP8
KV cache on a MoE model. Tensor parallelism (tp 2 == tp 1 == HF) is in test_tensor_parallel.py, the experts'
computation itself (torch and Triton) in test_fused_moe.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from minisrv import SamplingParams
from minisrv.kernels.fp8_quant import FP8
from minisrv.kernels.fused_moe import route
from minisrv.models.args import ModelArgs
from minisrv.models.moe import SparseMoE
from minisrv.models.sharding import ShardingError, check_divisible

from .helpers import (MOE_ARCHS, EngineWatch, assert_greedy_matches, assert_pool_free, greedy, hf_greedy,
                      hf_logits, make_llm, make_prompts, rel_err, vocab_of)
from .helpers.gguf_writer import write_gguf

MAX_TOKENS = 10

MODES = {
    "plain": dict(page_size=1),
    "chunked": dict(chunked_prefill_size=8, max_prefill_tokens=16, page_size=3),
    "retract": dict(max_total_tokens=64, page_size=2),
    "prefix_cache": dict(page_size=2, disable_radix_cache=False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_tokens_and_logits_match_hf(tiny_model, arch, mode):
    path = tiny_model(arch)
    prompts = make_prompts(vocab_of(path))
    llm = make_llm(path, **MODES[mode])
    if mode == "retract":
        from minisrv.engine.scheduler import MIN_NEW_TOKEN_RATIO
        llm.engine.scheduler.new_token_ratio = MIN_NEW_TOKEN_RATIO
    watch = EngineWatch(llm.engine)
    runs = 2 if mode == "prefix_cache" else 1  # the second run finds the first one's prompts cached
    for _ in range(runs):
        outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            ref, scores = hf_greedy(path, p, MAX_TOKENS)
            assert_greedy_matches(o.token_ids, ref, scores, f"{arch}/{mode} prompt {i}")
    assert watch.check_logits(path) >= len(prompts) * MAX_TOKENS * runs
    watch.assert_idle()
    if mode == "retract":
        assert llm.engine.scheduler.num_retractions > 0
    if mode == "chunked":
        assert watch.partial_extends > 0
    if mode == "prefix_cache":
        assert llm.engine.num_cached_prompt_tokens > 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_alone_equals_batched(tiny_model, arch):
    """Each prompt run alone gives the tokens it gets in the batch (where other tokens choose other experts)."""
    path = tiny_model(arch)
    prompts = make_prompts(vocab_of(path), [7, 30, 2], seed=5)
    llm = make_llm(path)
    batched = [o.token_ids for o in llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)]
    alone = [llm.generate([p], greedy(MAX_TOKENS), use_tqdm=False)[0].token_ids for p in prompts]
    assert alone == batched


def test_layers_follow_the_config(tiny_model):
    """mlp_only_layers, decoder_sparse_step and Mixtral's all-sparse layers decide which MLPs are MoE blocks."""
    kinds = {}
    for arch in MOE_ARCHS:
        model = make_llm(tiny_model(arch)).engine.runner.model
        kinds[arch] = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert kinds == {"qwen3_moe": [True, False, True], "qwen3_moe_top4": [False, True], "mixtral": [True, True],
                     "qwen2_moe": [True, True]}
    shared = make_llm(tiny_model("qwen2_moe")).engine.runner.model.model.layers[0].mlp
    assert shared.shared_expert is not None and shared.renormalize is False


def test_some_experts_get_no_token(tiny_model):
    """A decode step of one token at top-2 of 8 leaves six experts without a token; the logits still equal HF's
    (test above) and the route says which were hit."""
    weights, ids = route(torch.randn(1, 8), 2, True)
    assert ids.unique().numel() == 2 and abs(weights.sum().item() - 1) < 1e-6


@pytest.mark.parametrize("arch,gguf_arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_gguf_gives_the_safetensors_logits(tiny_model, tmp_path, arch, gguf_arch):
    """The same weights written as a GGUF file (experts stacked as ffn_*_exps, Mixtral as llama.cpp's "llama" with
    experts): its config reads back the same and its logits equal those from the safetensors directory."""
    path = tiny_model(arch)
    gguf = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, gguf, gguf_arch)
    a, b = make_llm(path), make_llm(gguf, tokenizer=path)
    for field in ("architecture", "num_experts", "experts_per_token", "moe_intermediate_size", "moe_layers",
                  "norm_topk_prob"):
        assert getattr(b.engine.parts.args, field) == getattr(a.engine.parts.args, field), field
    prompts = make_prompts(vocab_of(path), [20, 45], seed=25)
    rows = []
    for llm in (a, b):
        eng = llm.engine
        reqs = [eng.add_request(p, greedy(1)) for p in prompts]
        rows.append(eng.runner.forward_logits(eng.runner.build_forward_batch(eng.scheduler.schedule())))
        for r in reqs:
            eng.abort(r.rid)
        assert_pool_free(eng)
    assert rel_err(rows[1], rows[0]) < 1e-6
    assert rel_err(rows[1][1], hf_logits(path, prompts[1])[-1]) < 1e-4


def test_fp8_experts(tiny_model):
    """--quantization fp8: the experts in e4m3 with a scale per output row, each within one e4m3 rounding of the
    checkpoint's weight. These tiny random models amplify rounding (the dense Qwen3 in FP8 is 10-20% from its float32
    logits), so the MoE model's error against its float32 self is held to the dense model's, measured the same way:
    median at most 1.5 times it. The experts' FP8 arithmetic itself is checked against float64 in test_fused_moe.py
    (and the GPU kernel against it in tests/gpu/test_fused_moe.py)."""
    path = tiny_model("qwen3_moe")
    fp8, ref = make_llm(path, quantization="fp8"), make_llm(path)
    experts = fp8.engine.runner.model.model.layers[0].mlp.experts
    want = ref.engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == FP8 and experts.w2.dtype == FP8
    for q, scale, w in ((experts.w13, experts.w13_scale, want.w13), (experts.w2, experts.w2_scale, want.w2)):
        got = q.float() * scale[..., None]
        bound = 2.0 ** -4 * w.abs() + 2.0 ** -10 * scale[..., None] + 1e-12
        assert ((got - w).abs() <= bound).all()
    moe, dense = _fp8_median_error(path), _fp8_median_error(tiny_model("qwen3"))
    assert moe < 1.5 * dense, f"median error of the FP8 MoE model {moe:.2e}, of the dense one {dense:.2e}"


def _fp8_median_error(path: str) -> float:
    llm = make_llm(path, quantization="fp8")
    watch = EngineWatch(llm.engine)
    llm.generate(make_prompts(vocab_of(path), [6, 25]), greedy(6), use_tqdm=False)
    errs = sorted(watch.errors_against(_hf32(path)))
    return errs[len(errs) // 2]


def _hf32(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def test_prompt_logprobs_grammar_and_fp8_kv(tiny_model):
    """Features beside the model: prompt logprobs equal HF's, a regex constrains a MoE model's output, and an FP8
    KV cache serves it."""
    path = tiny_model("mixtral")
    prompt = make_prompts(vocab_of(path), [12], seed=3)[0]
    llm = make_llm(path)
    out = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    ref = torch.log_softmax(hf_logits(path, prompt), dim=-1)
    for p in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[p].logprob - ref[p - 1, prompt[p]].item()) < 1e-4
    text = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, regex="(t7|t9)+"),
                        use_tqdm=False)[0].text
    assert text and set(text.replace("t7", "").replace("t9", "")) == set()
    outs = make_llm(path, kv_cache_dtype="fp8_e4m3").generate([prompt], greedy(4), use_tqdm=False)
    assert len(outs[0].token_ids) == 4


def test_config_parsing_and_sharding_errors():
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=2, mlp_only_layers=[3])
    args = ModelArgs.from_hf_config(json.loads(json.dumps(base)))
    assert args.moe_layers == (1, 5) and args.num_experts == 8 and not args.norm_topk_prob
    dense = ModelArgs.from_hf_config({**base, "architectures": ["Qwen3ForCausalLM"], "num_experts": 0})
    assert dense.moe_layers == () and dense.num_experts == 0
    with pytest.raises(ShardingError, match="experts' width 25"):
        check_divisible(ModelArgs.from_hf_config({**base, "moe_intermediate_size": 25}), 2)
    check_divisible(args, 2)


def test_fp8_checkpoint_experts_load_within_two_roundings(tiny_model, tmp_path):
    """A block-scaled FP8 checkpoint (as Qwen3-30B-A3B-FP8's experts are stored): each expert is dequantised as it
    is read and requantised per row, within two e4m3 roundings of the checkpoint's own values."""
    from .test_fp8_weights import HALF_SUBNORMAL, U, _write_fp8_checkpoint
    dst = str(tmp_path / "fp8")
    originals = _write_fp8_checkpoint(tiny_model("qwen3_moe"), dst, [16, 16], kv_scales=False)
    llm = make_llm(dst)
    experts = llm.engine.runner.model.model.layers[2].mlp.experts
    assert experts.w13.dtype == FP8
    inter = experts.w2.shape[2]
    for e in range(experts.w13.shape[0]):
        for rows, name in ((slice(0, inter), "gate_proj"), (slice(inter, 2 * inter), "up_proj")):
            w = originals[f"model.layers.2.mlp.experts.{e}.{name}.weight"]
            scale = experts.w13_scale[e, rows, None]
            got = experts.w13[e, rows].float() * scale
            bound = (2 * U + U * U) * w.abs() + HALF_SUBNORMAL * (w.abs().amax() / 448.0 * 2 + scale) + 1e-12
            assert ((got - w).abs() <= bound).all(), f"expert {e} {name}"
    outs = llm.generate(make_prompts(vocab_of(dst), [6, 20]), greedy(6), use_tqdm=False)
    assert all(len(o.token_ids) == 6 for o in outs)
