"""The fa backend (attention/fa.py) on a CPU, its FlashAttention-3 call served by a float64 stand-in with FA3's
signature (helpers/fake_fa3.py): page tables, lengths and each layer's window, scale and learned sinks reach the
kernel as FA3 takes them, so gpt-oss (sinks, windowed and full layers), Gemma 3 and a windowed Mistral give HF's
greedy tokens and logits in decode and chunked extend steps; an FA3 build without `sinks` is refused for gpt-oss;
auto on an SM90 GPU gives a model with sinks to fa alone (fi lacks sinks), a soft-capped one to fi."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import minisrv.attention as registry
from minisrv.attention import BACKENDS, BackendUnavailable, resolve_backend
from minisrv.models.attention_options import SINKS, SOFTCAP, WINDOW, layer_attention

from .helpers import EngineWatch, assert_greedy_matches, greedy, hf_greedy, make_llm, make_prompts, vocab_of
from .helpers import fake_fa3


@pytest.fixture
def fake_fa(monkeypatch):
    from minisrv.attention import fa
    monkeypatch.setattr(fa, "_load_kernel", lambda: fake_fa3.flash_attn_with_kvcache)
    return fa


def _on_fa(fa, llm):
    eng = llm.engine
    layers = layer_attention(eng.parts.args, eng.runner.model.attention_sinks())
    backend = fa.FlashAttentionBackend(eng.parts.pool, eng.parts.table.table, eng.parts.args.num_heads, layers)
    eng.runner.use_parts(dataclasses.replace(eng.runner.parts, backend=backend))
    return backend


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3", "mistral_window"])
def test_engine_on_fa_matches_hf(tiny_model, fake_fa, arch):
    path = tiny_model(arch)
    llm = make_llm(path, page_size=4, chunked_prefill_size=8, max_prefill_tokens=8)
    backend = _on_fa(fake_fa, llm)
    assert any("window_size" in a for a in backend.layer_args)
    assert any("sinks" in a for a in backend.layer_args) == (arch == "gpt_oss")
    watch = EngineWatch(llm.engine)
    prompts = make_prompts(vocab_of(path), [5, 30, 17], seed=8)  # past the 8-token window but one
    outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, scores = hf_greedy(path, p, 8)
        assert_greedy_matches(o.token_ids, ref, scores, f"{arch} on fa")
    assert watch.check_logits(path) >= len(prompts) * 8


def test_a_build_without_sinks_is_refused_for_gpt_oss(tiny_model, fake_fa, monkeypatch):
    def no_sinks(q, k_cache, v_cache, cache_seqlens=None, page_table=None, cu_seqlens_q=None, max_seqlen_q=None,
                 softmax_scale=None, causal=False, window_size=(-1, -1)):
        raise AssertionError("not called")
    monkeypatch.setattr(fake_fa, "_load_kernel", lambda: no_sinks)
    llm = make_llm(tiny_model("gpt_oss"))
    with pytest.raises(ValueError, match="takes no attention sinks"):
        _on_fa(fake_fa, llm)


def test_auto_gives_sinks_to_fa_and_soft_caps_to_fi(monkeypatch, caplog):
    for name, entry in BACKENDS.items():  # as if every backend could run here
        monkeypatch.setitem(BACKENDS, name, (lambda sm: None, *entry[1:]))
    monkeypatch.setattr(registry, "device_sm", lambda device: 90)
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, frozenset({WINDOW, SINKS})) == "fa"
    assert resolve_backend("auto", cuda, frozenset({WINDOW, SOFTCAP})) == "fi"
    assert resolve_backend("auto", cuda, frozenset({WINDOW})) == "fa,fi"
    for name in ("fi", "fa,fi", "fa,triton"):
        with pytest.raises(BackendUnavailable, match="does not serve learned attention sinks"):
            resolve_backend(name, cuda, frozenset({SINKS}))
    caplog.clear()
    with caplog.at_level("WARNING"):
        resolve_backend("auto", cuda, frozenset({SOFTCAP}))
    assert "falling back to fi" in caplog.text and "falling back to fa" not in caplog.text
