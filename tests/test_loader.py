"""Checkpoint loading: sharded checkpoints, a tied head stored anyway, GGUF checkpoints against HF, and clear
errors for unknown architectures and broken weights (truncated file, missing / mis-shaped / unexpected tensor),
after which loading a good model still works."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from minisrv.checkpoints.loader import WeightLoadError, load_model_args
from minisrv.models.args import UnsupportedArchitecture

from .helpers.checkpoint_edits import copy_model, edit_config, rewrite_weights, still_serves
from .helpers.gguf_writer import write_gguf
from .helpers import (assert_greedy_matches, assert_pool_free, build_tiny_model, greedy, hf_greedy, hf_logits,
                      make_llm, make_prompts, rel_err, vocab_of)

SUPPORTED = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def test_unsupported_rope_scaling_is_refused(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path)
    edit_config(path, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="dynamic.*supported: default, linear, llama3, longrope, yarn"):
        make_llm(path)


# ---------------------------------------------------------------------------------------------------------------
# checkpoints: sharded, tied head stored, and broken ones


def test_sharded_checkpoint(tmp_path):
    path = str(tmp_path / "sharded")
    build_tiny_model(path, "qwen3", seed=5)
    # re-save the same weights in several shards with an index
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = str(tmp_path / "sharded2")
    m.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(path, f), sharded)
    files = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert len(files) > 2 and os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    llm = make_llm(sharded)
    prompt = make_prompts(vocab_of(path), [20], seed=22)[0]
    out = llm.generate(prompt, greedy(8, logprobs=1), use_tqdm=False)[0]
    ref, scores = hf_greedy(path, prompt, 8)
    assert_greedy_matches(out.token_ids, ref, scores, "sharded")
    # an index naming a shard that is not there
    os.remove(os.path.join(sharded, sorted(files)[-1]))
    with pytest.raises(WeightLoadError, match="missing"):
        make_llm(sharded)


def test_tied_checkpoint_that_also_stores_lm_head(tiny_model, tmp_path):
    src = tiny_model("qwen2")
    path = copy_model(src, tmp_path)
    rewrite_weights(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    llm = make_llm(path)
    prompt = make_prompts(vocab_of(src), [11], seed=23)[0]
    out = llm.generate(prompt, greedy(6), use_tqdm=False)[0]
    ref, scores = hf_greedy(src, prompt, 6)
    assert_greedy_matches(out.token_ids, ref, scores, "tied with stored lm_head")


def test_unknown_architecture(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path)
    edit_config(path, architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedArchitecture) as e:
        make_llm(path)
    msg = str(e.value)
    assert "FooForCausalLM" in msg and all(name in msg for name in SUPPORTED)
    assert isinstance(e.value, ValueError)
    still_serves(tiny_model)


def test_truncated_weight_file(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path)
    f = os.path.join(path, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(WeightLoadError, match="model.safetensors is truncated or damaged"):
        make_llm(path)
    with open(f, "r+b") as fh:  # even the header cut short
        fh.truncate(5)
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        make_llm(path)
    still_serves(tiny_model)


def test_missing_tensor(tiny_model, tmp_path):
    path = copy_model(tiny_model("mistral"), tmp_path)
    rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        make_llm(path)
    still_serves(tiny_model)


def test_missing_untied_lm_head(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path)
    rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensor.*lm_head\.weight"):
        make_llm(path)


def test_misshaped_tensor(tiny_model, tmp_path):
    path = copy_model(tiny_model("qwen2"), tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    rewrite_weights(path, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight.*\(16, 64\).*expected \(32, 64\)"):
        make_llm(path)
    path = copy_model(tiny_model("qwen2"), tmp_path, "bias")
    rewrite_weights(path, lambda t: t.__setitem__("model.layers.1.self_attn.v_proj.bias", torch.zeros(31)))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias"):
        make_llm(path)
    still_serves(tiny_model)


def test_unexpected_tensor(tiny_model, tmp_path):
    path = copy_model(tiny_model("qwen3"), tmp_path)
    rewrite_weights(path, lambda t: t.__setitem__("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64)))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor 'model\.layers\.7\.mlp\.up_proj\.weight'"):
        make_llm(path)


def test_missing_files(tiny_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_llm(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_llm(str(empty))
    path = copy_model(tiny_model("llama"), tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(WeightLoadError, match="no .*safetensors"):
        make_llm(path)


def test_float32_logits_of_a_loaded_checkpoint_match_hf_float32(tiny_model):
    """The same forward against HF run in float32 too (not only float64)."""
    path = tiny_model("llama")
    eng = make_llm(path).engine
    prompt = make_prompts(vocab_of(path), [33], seed=24)[0]
    from transformers import AutoModelForCausalLM
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref32 = hf32(torch.tensor([prompt])).logits[0, -1]
    req = eng.add_request(prompt, greedy(1))
    batch = eng.scheduler.schedule()
    logits = eng.runner.forward_logits(eng.runner.build_forward_batch(batch))[0]
    eng.abort(req.rid)
    assert rel_err(logits, ref32) < 1e-4
    assert rel_err(logits, hf_logits(path, prompt)[-1]) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# GGUF: a tiny checkpoint written the way llama.cpp's converter writes one (float32 tensors, llama.cpp names, Llama
# q/k rows permuted for its rotary), loaded through the GGUF path and compared with HF on the original weights

@pytest.mark.parametrize("name,arch,overrides", [
    ("llama", "llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            max_position_embeddings=256)),
    ("qwen2", "qwen2", dict()),  # tied (no output.weight), qkv biases, not permuted
])
def test_gguf_checkpoint_matches_hf(tmp_path, name, arch, overrides):
    hf_dir = build_tiny_model(str(tmp_path / "hf"), name, seed=9, **overrides)
    gguf_file = str(tmp_path / "tiny.gguf")
    write_gguf(hf_dir, gguf_file, arch)
    llm = make_llm(gguf_file, tokenizer=hf_dir)
    args = llm.engine.parts.args
    ref_args = load_model_args(hf_dir)
    assert args.tie_word_embeddings == ref_args.tie_word_embeddings
    assert args.attention_bias == ref_args.attention_bias and args.rope_theta == ref_args.rope_theta
    prompts = make_prompts(vocab_of(hf_dir), [20, 45], seed=25)
    outs = llm.generate(prompts, greedy(10), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, scores = hf_greedy(hf_dir, p, 10)
        assert_greedy_matches(o.token_ids, ref, scores, f"{name} GGUF")
    eng = llm.engine
    req = eng.add_request(prompts[1], greedy(1))
    logits = eng.runner.forward_logits(eng.runner.build_forward_batch(eng.scheduler.schedule()))[0]
    eng.abort(req.rid)
    assert rel_err(logits, hf_logits(hf_dir, prompts[1])[-1]) < 1e-4
    assert_pool_free(eng)
