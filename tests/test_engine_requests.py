"""Requests the engine bounds or refuses: max_tokens None runs to the context, the pool bounds a request's length,
bad prompts and sampling parameters fail clearly without disturbing the engine, request ids are unique, and the
stats count what is queued and held."""
from __future__ import annotations

import dataclasses

import pytest

from minisrv import SamplingParams

from .helpers import assert_greedy_matches, assert_pool_free, greedy, hf_greedy, make_llm, make_prompts, vocab_of


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


def test_max_tokens_none_runs_to_the_context(model):
    llm = make_llm(model, context_length=32)
    prompt = make_prompts(vocab_of(model), [20], seed=34)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    ref, scores = hf_greedy(model, prompt, 12)
    assert_greedy_matches(out.token_ids, ref, scores, "max_tokens=None")
    assert_pool_free(llm.engine)


def test_pool_smaller_than_context_bounds_requests(model):
    """A request must fit in the pool: the limit is min(context, pool), and one that fits exactly runs."""
    llm = make_llm(model, max_total_tokens=40, page_size=4)
    vocab = vocab_of(model)
    with pytest.raises(ValueError, match="maximum context length is 40 tokens"):
        llm.generate(make_prompts(vocab, [35], seed=35)[0], greedy(6), use_tqdm=False)
    prompt = make_prompts(vocab, [34], seed=35)[0]
    out = llm.generate(prompt, greedy(6), use_tqdm=False)[0]
    ref, scores = hf_greedy(model, prompt, 6)
    assert_greedy_matches(out.token_ids, ref, scores, "pool-sized request")
    assert_pool_free(llm.engine)


# ---------------------------------------------------------------------------------------------------------------
# bad requests


@pytest.fixture(scope="module")
def small_ctx(model):
    return make_llm(model, context_length=64, page_size=4)


def _serves(llm, model) -> None:
    """The engine still serves: nothing is queued, the pool is free, a normal request matches HF."""
    eng = llm.engine
    assert not eng.has_work() and not eng.scheduler.by_id
    assert_pool_free(eng)
    prompt = make_prompts(vocab_of(model), [12], seed=36)[0]
    out = llm.generate(prompt, greedy(5), use_tqdm=False)[0]
    ref, scores = hf_greedy(model, prompt, 5)
    assert_greedy_matches(out.token_ids, ref, scores, "after a rejected request")
    assert_pool_free(eng)


@pytest.mark.parametrize("prompt,params,error,match", [
    ([[]], dict(), ValueError, "prompt is empty"),
    ("", dict(), ValueError, "prompt is empty"),
    ([[5] * 60], dict(max_tokens=5), ValueError, r"maximum context length is 64 tokens. However, you requested "
                                                 r"65 tokens \(60 in the prompt, 5 for the completion\)"),
    ([[5] * 64], dict(max_tokens=None), ValueError, "maximum context length is 64 tokens. However, your prompt has "
                                                    "64 tokens"),
    ([[5, 6, 100000]], dict(), ValueError, r"token ids must be integers in \[0, 448\)"),
    ([[5, -1]], dict(), ValueError, "token ids must be integers"),
    ([None], dict(), TypeError, "a prompt is a string or a list of token ids"),
])
def test_bad_prompts(small_ctx, model, prompt, params, error, match):
    with pytest.raises(error, match=match):
        small_ctx.generate(prompt, SamplingParams(temperature=0.0, **params), use_tqdm=False)
    _serves(small_ctx, model)


def test_one_bad_prompt_rejects_the_whole_batch_before_queueing(small_ctx, model):
    good = make_prompts(vocab_of(model), [5, 9], seed=37)
    with pytest.raises(ValueError, match="prompt is empty"):
        small_ctx.generate([good[0], good[1], []], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        small_ctx.generate(good, [greedy(4)] * 3, use_tqdm=False)
    _serves(small_ctx, model)


@pytest.mark.parametrize("params,match", [
    (dict(max_tokens=0), "max_tokens 0 generates nothing"),
    (dict(max_tokens=-3), "max_tokens must be at least 0"),
    (dict(temperature=-0.5), "temperature must be non-negative"),
    (dict(top_p=-0.1), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(top_k=-2), "top_k must be"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be in \(0, 100\]"),
    (dict(logprobs=21), "logprobs must be in"),
    (dict(stop=[""]), "stop strings must be non-empty"),
])
def test_bad_sampling_params(small_ctx, model, params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)
    # nor can a built one be changed into them: it is frozen, and a variant made with replace is validated anew
    sp = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(sp, next(iter(params)), next(iter(params.values())))
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(sp, **params)
    _serves(small_ctx, model)


def test_sampling_params_are_validated_once_per_process(small_ctx, model, monkeypatch):
    """Offline: made and run, a request's values are validated once (at construction), not again when the request
    is checked against the model; a variant (dataclasses.replace), or a copy that crossed a process boundary
    (pickled), is validated once more, and only once, however many requests use it."""
    import pickle
    calls = []
    validate = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: calls.append(1) or validate(self))
    sp = greedy(3)
    assert len(calls) == 1
    out = small_ctx.generate([5, 6, 7], sp, use_tqdm=False)[0]
    assert len(calls) == 1 and len(out.token_ids) == 3
    shorter = dataclasses.replace(sp, max_tokens=2)
    small_ctx.engine.make_request([5, 6, 7], shorter)
    small_ctx.engine.make_request([5, 6, 7], shorter)
    assert len(calls) == 2 and sp.max_tokens == 3
    received = pickle.loads(pickle.dumps(shorter))
    assert received == shorter
    small_ctx.engine.make_request([5, 6, 7], received)
    small_ctx.engine.make_request([5, 6, 7], received)
    assert len(calls) == 3
    _serves(small_ctx, model)


def test_duplicate_request_id(small_ctx, model):
    eng = small_ctx.engine
    eng.add_request([5, 6, 7], greedy(3), rid="same")
    with pytest.raises(ValueError, match="duplicate request id 'same'"):
        eng.add_request([8, 9], greedy(3), rid="same")
    while eng.has_work():
        eng.step()
    eng.add_request([8, 9], greedy(3), rid="same")  # a finished request's id may be reused
    while eng.has_work():
        eng.step()
    _serves(small_ctx, model)


def test_engine_stats(small_ctx):
    eng = small_ctx.engine
    r = eng.add_request([5, 6, 7, 8, 9], greedy(4))
    st = eng.stats()
    assert st["num_waiting"] == 1 and st["num_running"] == 0 and st["kv_pages_used"] == 0
    eng.step()
    st = eng.stats()
    assert st["num_running"] == 1 and st["kv_pages_used"] == 2  # 5 tokens in pages of 4
    eng.abort(r.rid)
    assert eng.stats()["kv_pages_used"] == 0 and eng.stats()["kv_usage"] == 0.0
