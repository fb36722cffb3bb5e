"""The fi backend over a pool whose windowed layers keep only their window, through the stand-in FlashInfer
(helpers/fake_flashinfer.py: attention computed from the planned pages, the plans checked): tiny Gemma 2 and Gemma 3
(windowed and global layers) and Mistral (every layer windowed) with windows of 8 tokens, shorter than the prompts,
give the torch backend's greedy tokens and logits over the same kind of pool: batched and alone, in prefill chunks
across the window's edge, with prefix-cache hits, and with decode steps run through the CUDA-graph hooks (fixed
buffers, padding rows). While fi serves, the windowed pages behind each request's window are given back (the pool's
bookkeeping checked every step by EngineWatch) and fi lists no windowed page a query's window does not reach.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Dict, List, Tuple

import pytest
import torch

from minisrv.attention import BACKENDS, HybridBackend, create_backend, serves_window_pool
from minisrv.engine.cuda_graph import CudaGraphRunner
from minisrv.kvcache import slots_for
from minisrv.models.attention_options import layer_attention
from minisrv.utils import ceil_div

from .helpers import (EngineWatch, assert_pool_free, fake_flashinfer, greedy, make_llm, make_prompts, rel_err,
                      tree_pages, vocab_of)
from .test_windowed_models import MODES

MAX_TOKENS = 10
LENS = [5, 40, 3, 23, 12, 31]
ARCHS = ["gemma2", "gemma3", "mistral_window"]


@pytest.fixture
def fake_fi(monkeypatch):
    """FlashInfer's stand-in, and the fi backend allowed on this machine: an engine asked for fi builds its pool and
    backend as on a GPU (without CUDA graphs)."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setitem(BACKENDS, "fi", (lambda sm: None, *BACKENDS["fi"][1:]))
    from minisrv.attention import fi
    monkeypatch.setattr(fi, "WORKSPACE_BYTES", 1024)
    return fi


def fi_llm(fi, path, **opts):
    llm = make_llm(path, attention_backend="fi", **opts)
    backend = llm.engine.runner.backend
    assert isinstance(backend, fi.FlashInferBackend) and backend.window_table is llm.engine.parts.table.window_table
    assert llm.engine.parts.pool.window_layers, "the engine has no windowed pool"
    return llm, backend


def run(llm, prompts, repeat: bool = False) -> Tuple[List[List[int]], Dict[Tuple[int, ...], list]]:
    """Greedy tokens of each prompt, and every logits row computed, keyed by the request's prompt; the pool's
    bookkeeping checked after every step. repeat: serve the prompts twice (the second time from the prefix tree)."""
    watch = EngineWatch(llm.engine)
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    if repeat:
        outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    watch.assert_idle()
    assert_pool_free(llm.engine)
    rows: Dict[Tuple[int, ...], list] = {}
    for rid, req in watch.reqs.items():
        rows.setdefault(tuple(req.prompt_ids), []).extend(watch.logits.get(rid, []))
    return [o.token_ids for o in outs], rows


# a pool of 14 windowed pages of 2 (28 tokens), chunks of 5 that cross a window's edge, the prefix cache on
SMALL_WINDOWED_POOL = dict(page_size=2, chunked_prefill_size=5, max_prefill_tokens=10, max_total_tokens=512,
                           swa_full_tokens_ratio=0.01, disable_radix_cache=False)


def small_windowed_pool_run(path: str):
    """Six prompts longer than such a pool's windows, and the torch backend's run of them over it."""
    prompts = make_prompts(vocab_of(path), [30, 21, 9, 26, 14, 33], seed=11)
    return prompts, run(make_llm(path, **SMALL_WINDOWED_POOL), prompts)


def assert_same(got, want, label: str) -> None:
    (tokens, rows), (want_tokens, want_rows) = got, want
    assert tokens == want_tokens, f"{label}: greedy tokens differ from the torch backend's"
    assert rows.keys() == want_rows.keys()
    count = 0
    for prompt, got_rows in rows.items():
        ref = dict(want_rows[prompt])
        for pos, row in got_rows:
            err = rel_err(row, ref[pos])
            assert err < 1e-5, f"{label}: {len(prompt)}-token prompt, logits at {pos} off by {err:.2e}"
            count += 1
    assert count >= len(tokens) * MAX_TOKENS


def matches_torch_over_the_window_pool(path: str, mode: str, serve, label: str):
    """Serve `path` (serve(path, **opts) -> (llm, backend)) in MODES[mode]: the torch backend's greedy tokens and
    logits over the same kind of pool, and (batched) each prompt alone gives the batch's tokens. Returns the backend."""
    prompts = make_prompts(vocab_of(path), LENS, seed=5)
    cached = mode == "prefix_cache"
    if cached:  # prompts that extend an earlier one's cached pages, past the window
        prompts += [prompts[1][:30] + p for p in make_prompts(vocab_of(path), [4, 11], seed=6)]
    want = run(make_llm(path, **MODES[mode]), prompts, repeat=cached)
    llm, backend = serve(path, **MODES[mode])
    got = run(llm, prompts, repeat=cached)
    assert_same(got, want, label)
    if cached:
        assert llm.engine.num_cached_prompt_tokens > 0
    if mode == "batched":
        alone = [llm.generate([p], greedy(MAX_TOKENS), use_tqdm=False)[0].token_ids for p in prompts]
        assert alone == got[0]
    return backend


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_fi_matches_torch_over_the_window_pool(tiny_model, fake_fi, arch, mode):
    backend = matches_torch_over_the_window_pool(tiny_model(arch), mode, lambda p, **o: fi_llm(fake_fi, p, **o),
                                                 f"{arch}/{mode} on fi")
    windowed = tuple(a.window is not None for a in backend.kinds)
    assert backend.windowed == windowed  # Gemma: both tables listed each step; Mistral: the window table alone
    assert backend.tables == tuple(sorted(set(windowed)))


def test_windowed_pages_behind_the_window_are_given_back_on_fi(tiny_model, fake_fi):
    """Six prompts over 28 windowed tokens (a pool of 14 windowed pages of 2): the chunks of 5 cross the window's
    edge; every step each request holds only the windowed pages its window reaches (EngineWatch), fi lists no more
    of them than its queries' windows reach, and the tokens and logits are the torch backend's on the same pool."""
    path = tiny_model("gemma2")
    prompts, want = small_windowed_pool_run(path)
    llm, backend = fi_llm(fake_fi, path, **SMALL_WINDOWED_POOL)
    assert llm.engine.parts.window_allocator.num_pages == 14
    listed = []
    page_list = backend._page_list

    def checked_page_list(b, windowed, pad=0):
        pages = page_list(b, windowed, pad)
        if windowed:  # request i's windowed keys: from the page its first query's window starts in to its end
            counts = (pages.indptr[1:] - pages.indptr[:-1]).tolist()
            for n, s, e in zip(counts, b.seq_lens_cpu, b.extend_lens_cpu):
                assert n == ceil_div(s, 2) - max(0, s - e - 7) // 2 and n <= ceil_div(e + 7, 2) + 1
            listed.extend(counts)
        return pages

    backend._page_list = checked_page_list
    assert_same(run(llm, prompts), want, "small windowed pool on fi")
    assert listed and max(listed) <= 7  # (a chunk of 5 and the 7 keys before it: at most 7 pages of 2)
    assert len(tree_pages(llm.engine)) > 60 and len(tree_pages(llm.engine, window=True)) <= 14


class EagerGraph:
    def __init__(self, run) -> None:
        self.replay = run


class EagerGraphs(CudaGraphRunner):
    """CudaGraphRunner with each graph run eagerly on its static buffers: the runner's padding and the backend's
    capture and replay hooks as on a GPU, without a capture."""

    @torch.inference_mode()
    def capture(self) -> None:
        self.replayed: List[int] = []  # the batch size of each replay
        for bs in reversed(self.sizes):
            fb = self._static_batch(bs, [1] * bs)
            meta = self.meta[bs] = self.backend.prepare_for_capture(fb)
            graph = EagerGraph(lambda fb=fb, meta=meta, bs=bs: self.logits.__setitem__(bs, self._run(fb, meta)))
            graph.replay()  # a capture's warm-up run: padding rows write their K/V to the pad slots
            self.graphs[bs] = graph

    def replay(self, fb):
        self.replayed.append(fb.batch_size)
        return super().replay(fb)


def logprobs(outs) -> List[List[Tuple[int, float, Dict[int, float]]]]:
    return [[(t.token_id, t.logprob, t.top) for t in o.logprobs] for o in outs]


def graph_decode_matches_torch(path, serve, monkeypatch):
    """Serve `path` (serve(path, **opts) -> (llm, backend)) with its decode steps through EagerGraphs, the pad row's
    pages (one of each kind, which no request holds) taken as the engine's set-up takes them where it captures
    graphs: the tokens and the top-5 logprobs of every one equal the torch backend's, and some replays are padded.
    Returns (backend, graphs)."""
    opts = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=64, max_running_requests=8)
    prompts = make_prompts(vocab_of(path), [5, 40, 3, 23, 12, 31, 9], seed=3)
    params = greedy(MAX_TOKENS, logprobs=5)
    want = make_llm(path, **opts).generate(prompts, params, use_tqdm=False)
    llm, backend = serve(path, **opts)
    parts, runner, ps = llm.engine.parts, llm.engine.runner, 4
    pad_page, window_pad_page = parts.allocator.alloc(1)[0], parts.window_allocator.alloc(1)[0]
    parts.table.write(parts.pad_row, 0, slots_for([pad_page], ps, 0, ps))
    parts.table.write(parts.pad_row, 0, slots_for([window_pad_page], ps, 0, ps), window=True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    graphs = EagerGraphs(runner.model, backend, parts.pad_row, pad_page * ps, 8, parts.context_length, parts.device)
    runner.use_parts(dataclasses.replace(runner.parts, graph_runner=graphs))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(logprobs(got), logprobs(want)):
        for (gt, glp, gtop), (wt, wlp, wtop) in zip(g, w):
            assert gt == wt and abs(glp - wlp) < 1e-4 and gtop.keys() == wtop.keys()
            assert max(abs(gtop[t] - wtop[t]) for t in gtop) < 1e-4
    assert len(graphs.replayed) >= MAX_TOKENS - 1
    assert set(graphs.replayed) - set(graphs.sizes), "no replay was padded"
    return backend, graphs


@pytest.mark.parametrize("arch", ["gemma3", "mistral_window"])
def test_graph_decode_on_fi_matches_torch(tiny_model, fake_fi, monkeypatch, arch):
    """Decode steps through fi's CUDA-graph path: per table fixed index buffers (the stand-in's graph-mode wrappers
    read them when they run, as a replayed kernel does), the windowed slots gathered into a fixed buffer before each
    replay, padding rows on the pad row."""
    backend, graphs = graph_decode_matches_torch(tiny_model(arch), lambda p, **o: fi_llm(fake_fi, p, **o),
                                                 monkeypatch)
    assert set(backend.g_buffers) == set(backend.tables) and backend.g_window_loc is not None
    used = {min(n for n in graphs.sizes if n >= bs) for bs in graphs.replayed}
    assert all(w.plans > 1 for n in used for w in backend.graph_wrappers[n])  # planned at capture, then replays


def test_registry_routes_the_window_pool(tiny_model, fake_fi):
    """torch, fa and fi (and hybrids of them) read a windowed pool, each half through both tables; the others are
    refused one, and an engine asked for them keeps one full pool."""
    assert all(serves_window_pool(n) for n in ("torch", "fi", "fa", "torch,fi", "fa,fi", "fi,fa"))
    assert not any(serves_window_pool(n) for n in ("fi,triton", "fa,triton"))
    parts = make_llm(tiny_model("gemma2"), page_size=2).engine.parts
    args = (parts.pool, parts.table.table, parts.args.num_heads)
    kw = dict(layers=layer_attention(parts.args), window_table=parts.table.window_table)
    for name in ("fa,triton", "fi,triton"):
        with pytest.raises(ValueError, match="reads every layer's K/V through one request->token table"):
            create_backend(name, *args, **kw)
    hybrid = create_backend("torch,fi", *args, **kw)
    assert isinstance(hybrid, HybridBackend) and hybrid.prefill_backend.window_table is parts.table.window_table
    assert hybrid.decode_backend.tables == (False, True) and hybrid.decode_backend.windowed == (True, False)


def test_a_model_without_windows_plans_one_table_as_before(tiny_model, fake_fi):
    """Without windowed pages, each step lists one table's pages, plans each wrapper once, stores at the step's
    slots alone; its graphs have one table's buffers."""
    llm = make_llm(tiny_model("llama"), attention_backend="fi", page_size=2)
    backend = llm.engine.runner.backend
    assert backend.window_table is None and backend.tables == (False,) and backend.windowed == (False,)
    metas = []
    prepare = backend.prepare
    backend.prepare = lambda b: metas.append(prepare(b)) or metas[-1]
    llm.generate(make_prompts(vocab_of(tiny_model("llama")), [5, 9, 3], seed=1), greedy(4), use_tqdm=False)
    assert metas and all(m.window_loc is None and len(m.pages) == 1 for m in metas)
    wrappers = backend.decode_wrappers + backend.prefill_wrappers
    assert sum(w.plans for w in wrappers) == len(metas)
    backend.init_graph_state(4, 64)
    assert set(backend.g_buffers) == {False} and backend.g_window_loc is None
