"""Windowed layers that keep only their window, on a CUDA GPU: tiny Gemma 2 and Gemma 3 (heads of 128, windows of 32
tokens, shorter than the prompts) on FlashInfer (and Gemma 3 on FA3) over the windowed pool, with CUDA-graph decode,
prefill chunks that cross the window's edge and prefix-cache hits, give the tokens of the same backend over one full
pool (the same kernels over other pages: equal up to bf16 near-ties), and each running request holds only the
windowed pages its window reaches. (Against the torch backend, bf16 rounding in different kernels swaps tokens whose
logprobs are 0.2-0.3 apart in these tiny random models; the CPU suite checks the pool against float64 stand-ins.)"""
from __future__ import annotations

import pytest
import torch

from minisrv import LLM, SamplingParams
from minisrv.utils import ceil_div

from ..helpers import build_tiny_model, make_prompts, vocab_of
from .common import assert_same_up_to_ties, free_cuda, skip_unless_runs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WINDOW, CHUNK, PAGE = 32, 48, 16


def _serve(path, backend: str, prompts, windowed: bool = True):
    with pytest.MonkeyPatch.context() as mp:
        if not windowed:  # one full pool: set-up takes no backend for one that reads the windowed pool
            mp.setattr("minisrv.engine.setup.serves_window_pool", lambda name: False)
        llm = LLM(model=path, attention_backend=backend, dtype="bfloat16", page_size=PAGE, chunked_prefill_size=CHUNK,
                  max_prefill_tokens=2 * CHUNK, max_total_tokens=16384, swa_full_tokens_ratio=0.25,
                  log_level="warning")
    eng = llm.engine
    held = []  # each step: the most windowed pages a running request holds
    step = eng.step

    def watched_step():
        out = step()
        held.append(max((sum(p is not None for p in r.window_pages) for r in eng.scheduler.running), default=0))
        return out

    eng.step = watched_step
    try:
        assert bool(eng.parts.pool.window_layers) == windowed, f"{backend}: windowed layers {windowed}"
        assert eng.runner.graph_runner is not None
        if backend == "fi" and windowed:
            assert eng.runner.backend.tables == (False, True)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outs += llm.generate(prompts[-2:], params, use_tqdm=False)  # now from the prefix tree
        assert eng.num_cached_prompt_tokens > 0
    finally:
        llm.close()
        del llm
        free_cuda()
    # a request holds the pages its window and one chunk reach, and the next one
    assert not windowed or max(held) <= ceil_div(WINDOW + CHUNK, PAGE) + 1, \
        f"{backend}: windowed pages were not given back"
    return outs


@pytest.mark.parametrize("arch,backend", [("gemma2", "fi"), ("gemma3", "fi"), ("gemma3", "fa")])
def test_over_the_window_pool_matches_torch(tmp_path_factory, arch, backend):
    skip_unless_runs(backend)
    path = build_tiny_model(str(tmp_path_factory.mktemp(arch)), arch, seed=4, head_dim=128, sliding_window=WINDOW)
    prompts = make_prompts(vocab_of(path), [40, 150, 33, 97, 5, 70], seed=9)
    prompts += [prompts[1][:120] + p for p in make_prompts(vocab_of(path), [9, 30], seed=10)]
    want = _serve(path, backend, prompts, windowed=False)
    got = _serve(path, backend, prompts)
    assert_same_up_to_ties(want, got, f"{arch} on {backend} over the windowed pool against one full pool")
