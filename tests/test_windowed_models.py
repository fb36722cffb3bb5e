"""Models whose attention is windowed, soft-capped or scaled their own way, against HF transformers in float64: tiny
random Gemma 2 (every other layer windowed, attention and final logits soft-capped), Gemma 3 (five-to-one windows
here one-to-one, two rope bases, q/k norms), Gemma 3 as the language model of a Gemma3ForConditionalGeneration
checkpoint (vision tower present, not read) and Mistral (every layer windowed), all with windows of 8 tokens, shorter
than most prompts.

Greedy tokens equal HF's and every logits row the engine computes is within 1e-4 of HF's at that position: batched
and one prompt at a time, in prefill chunks that cross the window's edge, with the prefix cache on, and on the fi
backend (through the stand-in FlashInfer: its per-kind wrappers and their window and soft-cap arguments).
"""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from minisrv.attention import BACKENDS, BackendUnavailable, create_backend, resolve_backend
from minisrv.kvcache import KVPool
from minisrv.models.attention_options import SOFTCAP, WINDOW, LayerAttention, features_of, layer_attention

from .helpers import (WINDOW_ARCHS, EngineWatch, assert_greedy_matches, assert_pool_free, fake_flashinfer, greedy,
                      hf_greedy, hf_logits, make_llm, make_prompts, rel_err, vocab_of)

MAX_TOKENS = 12
LENS = [5, 40, 3, 23, 12, 31]

MODES = {
    "batched": dict(page_size=1),
    # chunks as long as the window, and chunks of 5 on pages of 4: chunk edges fall inside and across windows
    "chunked": dict(page_size=3, chunked_prefill_size=8, max_prefill_tokens=8),
    "chunked_odd": dict(page_size=4, chunked_prefill_size=5, max_prefill_tokens=10),
    "prefix_cache": dict(page_size=2, disable_radix_cache=False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", WINDOW_ARCHS)
def test_greedy_and_logits_match_hf(tiny_model, arch, mode):
    path = tiny_model(arch)
    prompts = make_prompts(vocab_of(path), LENS, seed=5)
    if mode == "prefix_cache":  # prompts that extend an earlier one's cached pages, past the window
        prompts += [prompts[1][:30] + p for p in make_prompts(vocab_of(path), [4, 11], seed=6)]
    llm = make_llm(path, **MODES[mode])
    watch = EngineWatch(llm.engine)
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    if mode == "prefix_cache":
        outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)  # now from the tree
        assert llm.engine.num_cached_prompt_tokens > 0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref, scores = hf_greedy(path, p, MAX_TOKENS)
        assert_greedy_matches(o.token_ids, ref, scores, f"{arch}/{mode} prompt {i} ({len(p)} tokens)")
    assert watch.check_logits(path) >= len(prompts) * MAX_TOKENS
    watch.assert_idle()
    if "chunked" in mode:
        assert watch.partial_extends > 0, "no prefill was chunked"
    assert_pool_free(llm.engine)


@pytest.mark.parametrize("arch", WINDOW_ARCHS)
def test_alone_equals_batched_and_prefill_logits_match_hf(tiny_model, arch):
    """Each prompt alone gives the batch's tokens; one prefill step's logits at every position equal HF's (positions
    before, at and past the window's edge, and a prompt longer than the rope's cache of the local layers needs)."""
    path = tiny_model(arch)
    llm = make_llm(path, page_size=4)
    prompts = make_prompts(vocab_of(path), LENS, seed=5)
    batched = [o.token_ids for o in llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)]
    alone = [llm.generate([p], greedy(MAX_TOKENS), use_tqdm=False)[0].token_ids for p in prompts]
    assert alone == batched
    eng = llm.engine
    prompts = make_prompts(vocab_of(path), [1, 8, 9, 100], seed=7)
    reqs = [eng.add_request(p, greedy(1)) for p in prompts]
    fb = eng.runner.build_forward_batch(eng.scheduler.schedule())
    with torch.inference_mode():
        logits = eng.runner.model.compute_logits(eng.runner.model(fb.input_ids, fb.positions,
                                                                   eng.runner.backend.step(fb)))
    start = 0
    for p in prompts:
        ref = hf_logits(path, p)
        worst = max(rel_err(logits[start + t], ref[t]) for t in range(len(p)))
        assert worst < 1e-4, f"{len(p)}-token prompt: worst position off by {worst:.2e}"
        start += len(p)
    for r in reqs:
        eng.abort(r.rid)
    assert_pool_free(eng)


@pytest.fixture
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    from minisrv.attention import fi
    monkeypatch.setattr(fi, "WORKSPACE_BYTES", 1024)
    return fi


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_engine_on_fi_matches_hf(tiny_model, fake_fi, arch):
    """The fi backend plans one wrapper of each sort per kind of layer (Gemma: windowed and global), each with its
    window, soft-cap and scale, the windowed ones over their own pages; the engine on it (decode and extend) gives
    HF's logits. Cascade decode is refused for a windowed model."""
    path = tiny_model(arch)
    llm = make_llm(path, page_size=4, chunked_prefill_size=8, max_prefill_tokens=8)
    eng = llm.engine
    layers = layer_attention(eng.parts.args)
    backend = create_backend("fi", eng.parts.pool, eng.parts.table.table, eng.parts.args.num_heads, layers=layers,
                             window_table=eng.parts.table.window_table)
    assert len(backend.kinds) == 2 and not backend.supports_cascade and backend.tables == (False, True)
    eng.runner.use_parts(dataclasses.replace(eng.runner.parts, backend=backend))
    watch = EngineWatch(eng)
    prompts = make_prompts(vocab_of(path), [5, 30, 17], seed=8)
    outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, scores = hf_greedy(path, p, 8)
        assert_greedy_matches(o.token_ids, ref, scores, f"{arch} on fi")
    assert watch.check_logits(path) >= len(prompts) * 8
    assert all(w.plans > 0 for w in backend.decode_wrappers + backend.prefill_wrappers)


def test_layer_options_read_from_the_configs(tiny_model):
    """Which layers are windowed, the scale and the soft-cap, as each architecture's config says."""
    from minisrv.checkpoints.model_files import load_model_args
    g2 = layer_attention(load_model_args(tiny_model("gemma2")))
    assert [a.window for a in g2] == [8, None, 8]
    assert {a.softcap for a in g2} == {3.0} and {a.scale for a in g2} == {24 ** -0.5}
    g3 = load_model_args(tiny_model("gemma3"))
    assert [a.window for a in layer_attention(g3)] == [8, None, 8, None]
    assert g3.local_rope_theta == 500.0 and g3.rope_theta == 50000.0 and g3.rope_scaling["factor"] == 4.0
    mm = load_model_args(tiny_model("gemma3_mm"))
    assert mm.sliding_layers == (0, 1) and mm.vocab_size == 256 and mm.qk_norm and mm.gemma_norms
    assert (mm.rope_theta, mm.local_rope_theta) == (20000.0, 300.0)
    assert features_of(layer_attention(load_model_args(tiny_model("mistral_window")))) == {WINDOW}


def test_backends_lacking_a_feature_are_refused_and_auto_passes_them(monkeypatch):
    everywhere = {name: (lambda sm: None, *entry[1:]) for name, entry in BACKENDS.items()}
    for name, entry in everywhere.items():  # as if every backend could run here
        monkeypatch.setitem(BACKENDS, name, entry)
    cpu = torch.device("cpu")
    assert resolve_backend("fa,triton", cpu) == "fa,triton"
    with pytest.raises(BackendUnavailable, match="triton backend does not serve sliding-window attention"):
        resolve_backend("fa,triton", cpu, frozenset({WINDOW}))
    with pytest.raises(BackendUnavailable, match="attention logit soft-capping"):
        resolve_backend("fa,triton", cpu, frozenset({SOFTCAP}))
    for name in ("torch", "fi"):
        assert resolve_backend(name, cpu, frozenset({WINDOW, SOFTCAP})) == name
    for name in ("fa", "fa,fi"):  # FA3 serves windows; soft-capping (which builds may leave out) goes to fi
        assert resolve_backend(name, cpu, frozenset({WINDOW})) == name
        with pytest.raises(BackendUnavailable, match="fa backend does not serve attention logit soft-capping"):
            resolve_backend(name, cpu, frozenset({WINDOW, SOFTCAP}))
    assert resolve_backend("auto", cpu, frozenset({WINDOW, SOFTCAP})) == "torch"


def test_options_must_cover_every_layer_of_the_pool():
    pool = KVPool(2, 4, 1, 2, 8, torch.float32, torch.device("cpu"))
    table = torch.zeros((1, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="1 layers' attention options for a pool of 2 layers"):
        create_backend("torch", pool, table, 4, layers=[LayerAttention(0.5)])
