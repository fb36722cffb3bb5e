"""The fa backend (attention/fa.py) on a CPU, its FlashAttention-3 call served by a float64 stand-in with FA3's
signature (helpers/fake_fa3.py): page tables, lengths and each layer's window, scale and learned sinks reach the
kernel as FA3 takes them, so gpt-oss (sinks, windowed and full layers), Gemma 3 and a windowed Mistral, their windowed
layers keeping only their window, give HF's greedy tokens and logits in decode and chunked extend steps (more modes
against the torch backend, and CUDA-graph decode: tests/test_fa_window_pool.py); an FA3 build without `sinks` is
refused for gpt-oss; auto on an SM90 GPU gives a model with sinks to fa alone (fi lacks sinks), a soft-capped one
to fi."""
from __future__ import annotations

import pytest
import torch

import minisrv.attention as registry
from minisrv.attention import BACKENDS, BackendUnavailable, resolve_backend
from minisrv.models.attention_options import SINKS, SOFTCAP, WINDOW, layer_attention

from .helpers import EngineWatch, assert_greedy_matches, greedy, hf_greedy, make_llm, make_prompts, vocab_of


def fa_llm(fa, path, **opts):
    llm = make_llm(path, attention_backend="fa", **opts)
    backend = llm.engine.runner.backend
    assert isinstance(backend, fa.FlashAttentionBackend) and llm.engine.parts.pool.window_layers
    assert backend.window_table is llm.engine.parts.table.window_table
    return llm, backend


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3", "mistral_window"])
def test_engine_on_fa_matches_hf(tiny_model, fake_fa, arch):
    path = tiny_model(arch)
    llm, backend = fa_llm(fake_fa, path, page_size=4, chunked_prefill_size=8, max_prefill_tokens=8)
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
    monkeypatch.setattr(fake_fa, "load_kernel", lambda: no_sinks)
    parts = make_llm(tiny_model("gpt_oss")).engine.parts
    layers = layer_attention(parts.args, [torch.zeros(parts.args.num_heads)] * parts.args.num_layers)
    with pytest.raises(ValueError, match="takes no attention sinks"):
        fake_fa.FlashAttentionBackend(parts.pool, parts.table.table, parts.args.num_heads, layers)


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
