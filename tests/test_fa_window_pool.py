"""The fa backend over a pool whose windowed layers keep only their window, through FA3's stand-in
(helpers/fake_fa3.py): tiny Gemma 3, gpt-oss (windowed and full layers, sinks) and Mistral (every layer windowed) with
windows of 8 tokens give the torch backend's greedy tokens and logits over the same kind of pool, in the modes and
with the checks of tests/test_fi_window_pool.py (batched and alone, chunks across the window's edge, prefix-cache
hits; the pool's bookkeeping every step), and decode steps through the CUDA-graph hooks (a second static page table,
the windowed slots in a fixed buffer gathered before each replay, padding rows on the pad row's pages)."""
from __future__ import annotations

import pytest

from .test_fa_backend import fa_llm
from .test_fi_window_pool import (MODES, SMALL_WINDOWED_POOL, assert_same, graph_decode_matches_torch,
                                  matches_torch_over_the_window_pool, run, small_windowed_pool_run)

ARCHS = ["gemma3", "gpt_oss", "mistral_window"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_fa_matches_torch_over_the_window_pool(tiny_model, fake_fa, arch, mode):
    matches_torch_over_the_window_pool(tiny_model(arch), mode, lambda p, **o: fa_llm(fake_fa, p, **o),
                                       f"{arch}/{mode} on fa")


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_graph_decode_on_fa_matches_torch(tiny_model, fake_fa, monkeypatch, arch):
    backend, _ = graph_decode_matches_torch(tiny_model(arch), lambda p, **o: fa_llm(fake_fa, p, **o), monkeypatch)
    assert backend.static_window is not None and backend.verify_backend() is None


def test_a_small_windowed_pool_on_fa(tiny_model, fake_fa):
    """Six prompts over a pool of 14 windowed pages of 2, chunks of 5 crossing the window's edge: the windowed layers
    read and write only their own pages (far fewer than the full layers' slots), each request holding only those
    its window reaches every step (EngineWatch), and the tokens and logits are the torch backend's."""
    path = tiny_model("gpt_oss")
    prompts, want = small_windowed_pool_run(path)
    llm, _ = fa_llm(fake_fa, path, **SMALL_WINDOWED_POOL)
    assert llm.engine.parts.window_allocator.num_pages == 14
    assert_same(run(llm, prompts), want, "small windowed pool on fa")
