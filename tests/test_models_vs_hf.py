"""minisrv's models against HF transformers (float64) on tiny random-weight Llama (llama3 rope scaling), Qwen2
(qkv bias), Qwen3 (q/k norm) and Mistral checkpoints, in float32 on the torch backend.

Greedy tokens must equal HF `generate(do_sample=False)` token for token, under every scheduling mode: plain
batching, chunked prefill, retraction under a small pool, page sizes 1/3/4/16, a cap on running requests. Every
logits row the engine computes along the way must be within 1e-4 (relative) of HF's logits at that position.
"""
from __future__ import annotations

import pytest
import torch

from minisrv.batch import ForwardMode
from minisrv.engine.scheduler import MIN_NEW_TOKEN_RATIO

from .helpers import (ARCHS, EngineWatch, assert_greedy_matches, assert_pool_free, build_tiny_model, greedy,
                      hf_greedy, hf_logits, make_llm, make_prompts, rel_err, vocab_of)

MAX_TOKENS = 12

MODES = {
    "plain": dict(page_size=1),
    "page16": dict(page_size=16),
    "max_running_2": dict(page_size=2, max_running_requests=2),
    # prompts of up to 40 tokens go through in chunks of 8, pages of 3 never line up with chunks
    "chunked": dict(chunked_prefill_size=8, max_prefill_tokens=16, page_size=3),
    "chunked_tight": dict(chunked_prefill_size=8, max_prefill_tokens=8, page_size=4),
    # pools too small for the whole batch (186 tokens) but large enough for its largest request (52 tokens)
    "retract": dict(max_total_tokens=64, page_size=1),
    "retract_page16": dict(max_total_tokens=64, page_size=16),
    "retract_chunked": dict(max_total_tokens=56, page_size=2, chunked_prefill_size=8, max_prefill_tokens=16),
    # overlap scheduling (the CUDA default) forced on: step N+1 is scheduled before step N's tokens are read
    "overlap": dict(page_size=1, overlap=True),
    "overlap_retract_chunked": dict(max_total_tokens=56, page_size=2, chunked_prefill_size=8, max_prefill_tokens=16,
                                    overlap=True),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(tiny_model, arch, mode):
    path = tiny_model(arch)
    prompts = make_prompts(vocab_of(path))
    kw = dict(MODES[mode])
    overlap = kw.pop("overlap", False)
    llm = make_llm(path, **kw)
    llm.engine.overlap = overlap
    if "retract" in mode:
        # admit optimistically, as the scheduler does after a long run of uneventful decoding, so that decode
        # really runs out of pages and must retract
        llm.engine.scheduler.new_token_ratio = MIN_NEW_TOKEN_RATIO
    watch = EngineWatch(llm.engine)
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref, scores = hf_greedy(path, p, MAX_TOKENS)
        assert_greedy_matches(o.token_ids, ref, scores, f"{arch}/{mode} prompt {i} ({len(p)} tokens)")
        assert o.finish_reason == "length"
        assert o.prompt_token_ids == p
    n = watch.check_logits(path)
    assert n >= len(prompts) * MAX_TOKENS
    watch.assert_idle()
    if "retract" in mode:
        assert llm.engine.scheduler.num_retractions > 0, "the pool was meant to force retraction"
    if "chunked" in mode:
        assert watch.partial_extends > 0, "no prefill was chunked"
    else:
        assert watch.partial_extends == 0
    assert "decode" in watch.modes


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hf(tiny_model, arch):
    """One batched prefill step (prompts of 1 to 150 tokens, beyond llama3's original 64-position window): the
    logits at every prompt position, and the runner's last-position logits, against HF's."""
    path = tiny_model(arch)
    eng = make_llm(path).engine
    prompts = make_prompts(vocab_of(path), [1, 7, 40, 150, 64], seed=7)
    reqs = [eng.add_request(p, greedy(1)) for p in prompts]
    batch = eng.scheduler.schedule()
    assert batch.mode is ForwardMode.EXTEND
    assert [r.rid for r in batch.reqs] == [r.rid for r in reqs]
    assert batch.extend_lens == [len(p) for p in prompts]
    fb = eng.runner.build_forward_batch(batch)
    with torch.inference_mode():
        runner = eng.runner
        hidden = runner.model(fb.input_ids, fb.positions, runner.backend.step(fb))
        logits = runner.model.compute_logits(hidden)
        last = eng.runner.forward_logits(fb)
    # a float32 model on the CPU: a row of logits for every prompt token
    assert logits.dtype == torch.float32 and logits.shape == (sum(map(len, prompts)), vocab_of(path))
    start = 0
    for p, lrow in zip(prompts, last):
        ref = hf_logits(path, p)
        ours = logits[start:start + len(p)]
        start += len(p)
        assert rel_err(ours, ref) < 1e-4
        worst = max(rel_err(ours[t], ref[t]) for t in range(len(p)))
        assert worst < 1e-4, f"{len(p)}-token prompt: worst position off by {worst:.2e}"
        assert rel_err(lrow, ref[-1]) < 1e-4
    for r in reqs:
        assert eng.abort(r.rid) is not None
    assert_pool_free(eng)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_at_full_context(tiny_model, arch):
    """A request that ends exactly at the context length (the last rotary position is used) still matches HF."""
    path = tiny_model(arch)
    llm = make_llm(path, context_length=64, page_size=4)
    prompt = make_prompts(vocab_of(path), [56], seed=3)[0]
    out = llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    ref, scores = hf_greedy(path, prompt, 8)
    assert_greedy_matches(out.token_ids, ref, scores, f"{arch} at context end")
    assert_pool_free(llm.engine)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_repetition_penalty_matches_hf(tiny_model, arch):
    """Greedy with a repetition penalty (prompt and output tokens) equals HF generate with the same penalty."""
    path = tiny_model(arch)
    prompts = make_prompts(vocab_of(path), [4, 30], seed=11)
    # a short-vocabulary prompt repeats tokens, so the penalty matters from the first step
    prompts.append([5, 6, 5, 6, 5, 6, 7, 7])
    llm = make_llm(path)
    outs = llm.generate(prompts, greedy(MAX_TOKENS, repetition_penalty=1.5), use_tqdm=False)
    changed = 0
    for p, o in zip(prompts, outs):
        ref, scores = hf_greedy(path, p, MAX_TOKENS, repetition_penalty=1.5)
        assert_greedy_matches(o.token_ids, ref, scores, f"{arch} repetition_penalty")
        changed += ref != hf_greedy(path, p, MAX_TOKENS)[0]
    assert changed, "the penalty never changed a greedy choice: the test proves nothing"
    assert_pool_free(llm.engine)


def test_sliding_window_model_keeps_its_context_and_is_exact_past_its_window(tmp_path):
    """A Mistral whose sliding window (16) is shorter than its context is served over the whole context, windowed
    (tests/test_windowed_models.py checks windowed models in every scheduling mode)."""
    path = build_tiny_model(str(tmp_path / "window"), "mistral", seed=4, sliding_window=16)
    llm = make_llm(path, page_size=4)
    assert llm.engine.parts.context_length == 256
    prompt = make_prompts(vocab_of(path), [40], seed=41)[0]
    out = llm.generate(prompt, greedy(8), use_tqdm=False)[0]
    ref, scores = hf_greedy(path, prompt, 8)
    assert_greedy_matches(out.token_ids, ref, scores, "past the sliding window")
    assert_pool_free(llm.engine)
