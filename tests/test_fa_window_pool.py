"""The fa backend over a pool whose windowed layers keep only their window, through FA3's stand-in
(helpers/fake_fa3.py): tiny Gemma 3, gpt-oss (windowed and full layers, sinks) and Mistral (every layer windowed) with
windows of 8 tokens give the torch backend's greedy tokens and logits over the same kind of pool, in the modes and
with the checks of tests/test_fi_window_pool.py (batched and alone, chunks across the window's edge, prefix-cache
hits; the pool's bookkeeping every step), and decode steps through the CUDA-graph hooks (a second static page table,
the windowed slots in a fixed buffer gathered before each replay, padding rows on the pad row's pages)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from minisrv.kvcache import slots_for

from .helpers import greedy, make_llm, make_prompts, vocab_of
from .test_fa_backend import fa_llm, fake_fa  # noqa: F401 - the fixture
from .test_fi_window_pool import LENS, MAX_TOKENS, MODES, EagerGraphs, assert_same, logprobs, run

ARCHS = ["gemma3", "gpt_oss", "mistral_window"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_fa_matches_torch_over_the_window_pool(tiny_model, fake_fa, arch, mode):
    path = tiny_model(arch)
    prompts = make_prompts(vocab_of(path), LENS, seed=5)
    cached = mode == "prefix_cache"
    if cached:  # prompts that extend an earlier one's cached pages, past the window
        prompts += [prompts[1][:30] + p for p in make_prompts(vocab_of(path), [4, 11], seed=6)]
    want = run(make_llm(path, **MODES[mode]), prompts, repeat=cached)
    llm, backend = fa_llm(fake_fa, path, **MODES[mode])
    got = run(llm, prompts, repeat=cached)
    assert_same(got, want, f"{arch}/{mode}")
    if cached:
        assert llm.engine.num_cached_prompt_tokens > 0
    if mode == "batched":
        alone = [llm.generate([p], greedy(MAX_TOKENS), use_tqdm=False)[0].token_ids for p in prompts]
        assert alone == got[0]


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_graph_decode_on_fa_matches_torch(tiny_model, fake_fa, monkeypatch, arch):
    path = tiny_model(arch)
    opts = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=64, max_running_requests=8)
    prompts = make_prompts(vocab_of(path), [5, 40, 3, 23, 12, 31, 9], seed=3)
    params = greedy(MAX_TOKENS, logprobs=5)
    want = make_llm(path, **opts).generate(prompts, params, use_tqdm=False)
    llm, backend = fa_llm(fake_fa, path, **opts)
    parts, runner, ps = llm.engine.parts, llm.engine.runner, 4
    # the pad row's pages, as the engine's set-up takes them where it captures graphs
    pad_page, window_pad_page = parts.allocator.alloc(1)[0], parts.window_allocator.alloc(1)[0]
    parts.table.write(parts.pad_row, 0, slots_for([pad_page], ps, 0, ps))
    parts.table.write(parts.pad_row, 0, slots_for([window_pad_page], ps, 0, ps), window=True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    graphs = EagerGraphs(runner.model, backend, parts.pad_row, pad_page * ps, 8, parts.context_length, parts.device)
    assert backend.static_window is not None and backend.verify_backend() is None
    runner.use_parts(dataclasses.replace(runner.parts, graph_runner=graphs))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(logprobs(got), logprobs(want)):
        for (gt, glp, gtop), (wt, wlp, wtop) in zip(g, w):
            assert gt == wt and abs(glp - wlp) < 1e-4 and gtop.keys() == wtop.keys()
            assert max(abs(gtop[t] - wtop[t]) for t in gtop) < 1e-4
    assert len(graphs.replayed) >= MAX_TOKENS - 1
    assert set(graphs.replayed) - set(graphs.sizes), "no replay was padded"


def test_a_small_windowed_pool_on_fa(tiny_model, fake_fa):
    """Six prompts over a pool of 14 windowed pages of 2, chunks of 5 crossing the window's edge: the windowed layers
    read and write only their own pages (far fewer than the full layers' slots), each request holding only those
    its window reaches every step (EngineWatch), and the tokens and logits are the torch backend's."""
    path = tiny_model("gpt_oss")
    opts = dict(page_size=2, chunked_prefill_size=5, max_prefill_tokens=10, max_total_tokens=512,
                swa_full_tokens_ratio=0.01, disable_radix_cache=False)
    prompts = make_prompts(vocab_of(path), [30, 21, 9, 26, 14, 33], seed=11)
    want = run(make_llm(path, **opts), prompts)
    llm, _ = fa_llm(fake_fa, path, **opts)
    assert llm.engine.parts.window_allocator.num_pages == 14
    assert_same(run(llm, prompts), want, "small windowed pool on fa")
