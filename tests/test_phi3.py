"""Phi-3 and Phi-4 (Phi3ForCausalLM) against HF transformers (float64) on tiny random checkpoints written by
transformers' own Phi3ForCausalLM: "phi3" (fused qkv_proj and gate_up_proj, full rotary, untied) and "phi4_mini"
(LongRoPE over 0.75 of each head, tied, an original context of 32 positions that every prompt here crosses).

Greedy tokens and the logits of every computed row, batched and alone, chunked prefill, the prefix cache on, two
tensor-parallel ranks over gloo; the short factors where the served context stays within the original one; the
config as Phi-3 and Phi-4 checkpoints on the hub write it; Phi-3's sliding window; llama.cpp's phi3 GGUF files."""
from __future__ import annotations

import pytest
import torch

from minisrv.checkpoints.checkpoint import StoredTensor, WeightLoadError
from minisrv.checkpoints.loader import load_model_args
from minisrv.checkpoints.weights import split_fused
from minisrv.models.args import ModelArgs
from minisrv.models.sharding import Slice

from .helpers import (EngineWatch, assert_pool_free, build_tiny_model, greedy, hf_greedy,
                      hf_logits, make_config, make_llm, make_prompts, rel_err, vocab_of)
from .helpers.engine_modes import ENGINE_MODES, check_greedy, check_mode_against_hf, check_two_ranks

PHIS = ["phi3", "phi4_mini"]
LONG_PROMPTS = [40, 33, 57, 36]  # all past phi4_mini's original 32 positions: transformers takes the long factors


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
@pytest.mark.parametrize("name", PHIS)
def test_greedy_and_logits_match_hf(tiny_model, name, mode):
    path = tiny_model(name)
    check_mode_against_hf(path, path, make_prompts(vocab_of(path), LONG_PROMPTS, seed=5), mode, name)


def test_prefill_logits_match_hf_at_every_position(tiny_model):
    """One batched prefill of prompts crossing the original context: every position's logits (long factors,
    the attention factor on the turned dims only) against HF's teacher-forced forward."""
    path = tiny_model("phi4_mini")
    eng = make_llm(path).engine
    prompts = make_prompts(vocab_of(path), [33, 90, 64], seed=9)
    for p in prompts:
        eng.add_request(p, greedy(1))
    batch = eng.scheduler.schedule()
    fb = eng.runner.build_forward_batch(batch)
    with torch.inference_mode():
        logits = eng.runner.model.compute_logits(eng.runner.model(fb.input_ids, fb.positions,
                                                                  eng.runner.backend.step(fb)))
    for p, ours in zip(prompts, torch.split(logits, [len(p) for p in prompts])):
        ref = hf_logits(path, p)
        assert max(rel_err(ours[t], ref[t]) for t in range(len(p))) < 1e-4


def test_short_factors_where_the_context_stays_within_the_original(tiny_model):
    """Served with a context of at most original_max_position_embeddings, the short factors: every sequence then
    fits what transformers computes with them."""
    path = tiny_model("phi4_mini")
    llm = make_llm(path, context_length=32, page_size=4)
    check_greedy(path, llm, make_prompts(vocab_of(path), [5, 20, 12], seed=6), 10, "short factors")
    long_llm = make_llm(path)  # a context past 32: the long factors, which HF takes only for longer sequences
    short = make_prompts(vocab_of(path), [12], seed=6)
    assert long_llm.generate(short, greedy(10), use_tqdm=False)[0].token_ids != hf_greedy(path, short[0], 10)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", PHIS)
def test_two_ranks_give_hf_and_one_rank_tokens(tiny_model, name):
    """Each rank reads its own q, k, v heads and its gate and up halves out of the fused tensors."""
    path = tiny_model(name)
    check_two_ranks(path, path, make_prompts(vocab_of(path), LONG_PROMPTS, seed=7), name)


def test_config_as_the_hub_writes_it(tiny_model):
    """transformers 5's config.json (rope_parameters) and a transformers 4 one as Phi-4-mini's and Phi-3's on the
    hub (top-level partial_rotary_factor and original_max_position_embeddings, rope_scaling of type "longrope" or
    the older "su"), and Phi-3-mini-4k's sliding window."""
    saved = load_model_args(tiny_model("phi4_mini"))
    assert saved.architecture == "Phi3ForCausalLM" and saved.rotary_dim == 12 and saved.tie_word_embeddings
    assert saved.rope_scaling["original_max_position_embeddings"] == 32 and saved.rope_scaling["factor"] == 8.0
    assert load_model_args(tiny_model("phi3")).rope_scaling is None
    hub = make_config("phi4_mini").to_dict()
    long, short = hub["rope_parameters"]["long_factor"], hub["rope_parameters"]["short_factor"]
    for key in ("rope_parameters", "partial_rotary_factor"):
        hub.pop(key)
    for kind in ("longrope", "su"):
        hub.update(rope_theta=250000.0, partial_rotary_factor=0.75, architectures=["Phi3ForCausalLM"],
                   rope_scaling={"type": kind, "long_factor": long, "short_factor": short})
        args = ModelArgs.from_hf_config(hub)
        assert args.rope_theta == 250000.0 and args.rotary_dim == 12
        assert args.rope_scaling["rope_type"] == "longrope" and args.rope_scaling["factor"] == 256 / 32
        assert args.rope_scaling["long_factor"] == long and args.rope_scaling["original_max_position_embeddings"] == 32
    mini_4k = make_config("phi3", sliding_window=2047).to_dict()
    assert ModelArgs.from_hf_config(mini_4k).sliding_window == 2047


def test_phi3_sliding_window_is_applied_as_transformers_applies_it(tmp_path):
    """transformers masks Phi-3's sliding window whenever the config sets it (its logits past the window differ
    from the same weights' without one): every layer is windowed here too, with prompts longer than the window,
    batched and in chunks across its edge."""
    from transformers import AutoModelForCausalLM
    path = build_tiny_model(str(tmp_path / "window"), "phi3", seed=4, sliding_window=16)
    ids = make_prompts(vocab_of(path), [30], seed=2)[0]
    unwindowed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                                      sliding_window=None)
    with torch.no_grad():
        full = unwindowed(torch.tensor([ids])).logits[0]
    windowed = hf_logits(path, ids)
    assert rel_err(full[:16], windowed[:16]) < 1e-9 and rel_err(full[16:], windowed[16:]) > 1e-3
    assert load_model_args(path).sliding_layers == (0, 1)
    prompts = make_prompts(vocab_of(path), [30, 8, 45], seed=41)
    for kw in (dict(page_size=4), dict(chunked_prefill_size=8, max_prefill_tokens=16, page_size=3)):
        llm = make_llm(path, **kw)
        watch = EngineWatch(llm.engine)
        check_greedy(path, llm, prompts, 8, f"past the sliding window {kw}")
        assert watch.check_logits(path) >= len(prompts) * 8
        assert_pool_free(llm.engine)


def test_fused_tensors_are_read_as_their_parts():
    """split_fused: the parts' names and row ranges, a rank's slice of a part read from the fused tensor, and a
    fused tensor of the wrong height refused."""
    args = ModelArgs.from_hf_config(make_config("phi3").to_dict())  # 4 heads and 2 K/V heads of 16, MLP 128
    qkv = torch.arange(128 * 64, dtype=torch.float32).reshape(128, 64)
    gate_up = torch.randn(256, 64)
    parts = dict(split_fused(iter([("model.layers.0.self_attn.qkv_proj.weight", StoredTensor.in_memory(qkv)),
                                   ("model.layers.0.mlp.gate_up_proj.weight", StoredTensor.in_memory(gate_up))]),
                             args))
    assert list(parts) == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"] + \
        [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")]
    k = parts["model.layers.0.self_attn.k_proj.weight"]
    assert k.shape == (32, 64) and torch.equal(k.read(None), qkv[64:96])
    assert torch.equal(k.read(Slice(0, 16, 16)), qkv[80:96])  # rank 1 of 2: the second K/V head
    assert torch.equal(parts["model.layers.0.mlp.up_proj.weight"].read(Slice(0, 64, 64)), gate_up[192:])
    with pytest.raises(WeightLoadError, match="120 rows, expected 128"):
        list(split_fused(iter([("model.layers.0.self_attn.qkv_proj.weight", StoredTensor.in_memory(qkv[:120]))]),
                         args))


@pytest.mark.parametrize("name", PHIS)
def test_gguf_file_as_llama_cpp_writes_it(tiny_model, tmp_path, name):
    """A phi3 GGUF (fused attn_qkv and ffn_up, the rotary width, LongRoPE's factors as tensors): float32, its
    config and greedy tokens those of the HF checkpoint it was written from; Q8_0, kept in blocks, the tokens of
    the same file dequantised."""
    from .helpers.gguf_writer import write_gguf
    hf = tiny_model(name)
    f32, q8 = str(tmp_path / "f32.gguf"), str(tmp_path / "q8.gguf")
    write_gguf(hf, f32, "phi3")
    write_gguf(hf, q8, "phi3", quant="Q8_0")
    want, got = load_model_args(hf), load_model_args(f32)
    assert (got.architecture, got.rotary_dim, got.sliding_window) == (want.architecture, want.rotary_dim, None)
    if want.rope_scaling:
        assert got.rope_scaling["long_factor"] == pytest.approx(want.rope_scaling["long_factor"], rel=1e-6)
    prompts = make_prompts(vocab_of(hf), LONG_PROMPTS[:2], seed=8)
    check_greedy(hf, make_llm(f32, tokenizer=hf, cache_dir="off"), prompts, 8, f"{name} GGUF")
    blocks = make_llm(q8, tokenizer=hf, cache_dir="off", gguf_weights="blocks")
    dense = make_llm(q8, tokenizer=hf, cache_dir="off", gguf_weights="float32")
    assert [o.token_ids for o in blocks.generate(prompts, greedy(8), use_tqdm=False)] == \
        [o.token_ids for o in dense.generate(prompts, greedy(8), use_tqdm=False)]
