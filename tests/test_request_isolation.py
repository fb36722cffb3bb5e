"""One request never holds up the others: a grammar too costly to compile is refused after the engine's compile
timeout (an engine output naming the request's field, which the server answers with a 400, streamed or not) while
the other requests go on."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from unittest import mock

import pytest

from minisrv import SamplingParams
from minisrv.engine.request import RequestError, RequestOutput, RequestStatus, prompt_logprob_list
from minisrv.server.app import create_app
from minisrv.server.errors import APIError
from minisrv.server.generation import Job, run_jobs
from minisrv.server.messages import EngineInfo
from minisrv.server.state import ServerState

from .helpers import assert_pool_free, make_llm, make_prompts, vocab_of
from .helpers.local_engine import LocalEngine, call

TENS = r"(t1[0-9])+"


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return tiny_model("qwen3")


def _slowed(eng) -> threading.Event:
    """Make the engine's grammar compiles wait for the returned event (a compile that takes as long as a test
    wants)."""
    release = threading.Event()
    real = eng.grammar._compile

    def slow_compile(kind, text):
        assert release.wait(60), "never released"
        return real(kind, text)

    eng.grammar._compile = slow_compile
    return release


def test_a_compile_past_its_timeout_is_refused_and_the_others_finish(qwen3):
    """A compile that outlasts grammar_compile_timeout (counted from the request's arrival) ends its request with
    an error naming response_format; the plain request beside it finishes meanwhile, and a request sent later with
    the same grammar gets the compile's result once it is done (the cache holds it)."""
    llm = make_llm(qwen3, grammar_compile_timeout=30)
    eng = llm.engine
    release = _slowed(eng)
    prompts = make_prompts(vocab_of(qwen3), [5, 9], seed=3)
    plain = eng.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    t0 = time.monotonic()
    costly = eng.add_request(prompts[1], SamplingParams(temperature=0.0, max_tokens=6, regex=TENS))
    assert t0 + 30 <= costly.grammar.deadline <= time.monotonic() + 30
    while not plain.finished:  # the compile does not hold it up
        eng.step()
        assert costly.status is RequestStatus.WAITING
    assert plain.finish_reason == "length"
    news = eng.step()
    assert not costly.finished
    costly.grammar.deadline = time.monotonic()  # its 30 s have passed
    while not costly.finished:
        news += eng.step()
    assert costly.finish_reason == "error" and not costly.output_ids
    last = [o for o in news if o.rid == costly.rid][-1]
    assert last.finished and last.error_param == "response_format"
    assert last.error.startswith("the regex grammar did not compile within 30 s")
    assert eng.scheduler.num_constrained == 0 and not eng._compiling
    release.set()  # the compile finishes in its worker: the same grammar is served from the cache
    eng.grammar.submit(SamplingParams(regex=TENS)).future.result(30)
    again = eng.add_request(prompts[1], SamplingParams(temperature=0.0, max_tokens=6, regex=TENS))
    while eng.has_work():
        eng.step()
    assert again.finish_reason in ("stop", "length") and again.output_ids
    assert_pool_free(eng)


def test_offline_check_is_bounded_by_the_timeout(qwen3):
    llm = make_llm(qwen3, grammar_compile_timeout=0.3)
    release = _slowed(llm.engine)
    t0 = time.monotonic()
    with pytest.raises(RequestError, match="did not compile within 0.3 s") as e:
        llm.engine.grammar.check(SamplingParams(regex="(t2[0-9])+"))
    assert e.value.param == "response_format" and time.monotonic() - t0 < 10
    release.set()


def test_a_compile_within_its_timeout_is_served(qwen3):
    """The timeout counts from the request's arrival: a compile slower than the steps but inside it waits, not
    admitted, and is then served."""
    llm = make_llm(qwen3, grammar_compile_timeout=30)
    eng = llm.engine
    release = _slowed(eng)
    r = eng.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, regex=TENS))
    for _ in range(3):
        eng.step()
        assert r.status is RequestStatus.WAITING and not r.finished
    release.set()
    while eng.has_work():
        eng.step()
    assert r.finish_reason in ("stop", "length") and r.output_ids


def _run(outputs):
    """run_jobs over a stub engine client that answers each job with `outputs(rid)`: what it raises or yields."""
    def submit(rid, ids, params, sink, index):
        sink.put_nowait((index, outputs(rid)))

    state = SimpleNamespace(client=SimpleNamespace(submit=submit, abort=lambda rid: None), metrics=mock.MagicMock(),
                            stopping=False, on_stop=set())

    async def go():
        return [step async for step in run_jobs(state, [Job(0, "r-0", [1, 2], SamplingParams())])]
    return asyncio.run(go())


def _failed(rid, **kw):
    return RequestOutput(rid=rid, new_token_ids=[], new_text="", new_logprobs=[], text_offsets=[], finished=True,
                         finish_reason="error", **kw)


def test_the_server_answers_a_refused_grammar_with_a_400():
    with pytest.raises(APIError) as e:
        _run(lambda rid: _failed(rid, error="the regex grammar did not compile within 20 s",
                                 error_param="response_format"))
    assert e.value.status == 400 and e.value.param == "response_format"
    assert "did not compile" in e.value.message
    with pytest.raises(APIError) as e:  # an engine failure stays the server's (500)
        _run(lambda rid: _failed(rid, error="boom"))
    assert e.value.status == 500


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
REFUSED = [  # one grammar each (a compile in the cache would be served): a schema, a regex, forced tool calls
    ("/v1/chat/completions", {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {**PARAMS, "title": "chat"}}}}),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]}),
    ("/v1/completions", {"prompt": "Count:", "regex": "(t3[0-9])+"}),
    ("/v1/responses", {"input": ASK, "text": {"format": {"type": "json_schema", "name": "x",
                                                         "schema": {**PARAMS, "title": "responses"}}}}),
    ("/v1/messages", {"messages": ASK, "tool_choice": {"type": "tool", "name": "get_weather"},
                      "tools": [{"name": "get_weather", "input_schema": {**PARAMS, "title": "messages"}}]}),
]


@pytest.fixture(scope="module")
def refusing(tiny_qwen2_tools):
    """A server app whose engine's compiles never finish within its 0.05 s compile timeout."""
    from minisrv.engine.engine import Engine
    engine = Engine(model=tiny_qwen2_tools, attention_backend="torch", dtype="float32", log_level="warning",
                    max_total_tokens=4096, grammar_compile_timeout=0.05)
    release = _slowed(engine)
    yield engine, create_app(ServerState(client=LocalEngine(engine), tokenizer=engine.parts.tokenizer,
                                         served_model_name="m", info=EngineInfo.from_engine(engine)))
    release.set()


@pytest.mark.parametrize("path,body", REFUSED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REFUSED)])
def test_a_refused_grammar_is_the_same_400_streamed_or_not(refusing, path, body):
    """A stream opens at its request's first output: a grammar refused before it is answered with the HTTP 400
    (in the API's error shape) that the same request gets unstreamed, not a stream that only carries the error."""
    engine, app = refusing
    body = {"model": "m", "max_tokens": 8, **body}
    whole = call(app, path, body)
    streamed = call(app, path, {**body, "stream": True})
    for r in (whole, streamed):
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert streamed.json() == whole.json()
    if path == "/v1/messages":
        assert whole.json()["type"] == "error" and whole.json()["error"]["type"] == "invalid_request_error"
        assert "did not compile within 0.05 s" in whole.json()["error"]["message"]
    else:
        err = whole.json()["error"]
        assert err["param"] == "response_format" and "did not compile within 0.05 s" in err["message"], err
    assert not engine.has_work()
    assert_pool_free(engine)

# ---------------------------------------------------------------------------------------------- long prompts


@pytest.mark.parametrize("scored", [False, True])
def test_a_short_request_beside_a_long_prompt_does_not_wait_for_its_prefill(qwen3, scored):
    """A long prompt is prefilled in chunks; a short request that arrives meanwhile joins one chunk's step and
    then decodes its tokens in the steps after it, finishing long before the long prompt's prefill does (prompt
    scoring or not). Both answer as they do alone."""
    llm = make_llm(qwen3, chunked_prefill_size=8)
    eng = llm.engine
    vocab = vocab_of(qwen3)
    long_prompt, short_prompt = make_prompts(vocab, [200, 5], seed=4)
    long_params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2 if scored else None)
    short_params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    long = eng.add_request(long_prompt, long_params)
    eng.step()
    short = eng.add_request(short_prompt, short_params)
    steps = 0
    while not short.finished:
        eng.step()
        steps += 1
    assert long.num_cached < len(long_prompt) - 8, "the short request waited for the long prompt's prefill"
    assert steps <= 2 + 8  # its prefill with one chunk, then its decode steps (one chunk between, at most)
    while eng.has_work():
        eng.step()
    alone = make_llm(qwen3).generate([long_prompt, short_prompt], [long_params, short_params], use_tqdm=False)
    assert long.output_ids == alone[0].token_ids and short.output_ids == alone[1].token_ids
    if scored:
        got, want = prompt_logprob_list(long)[1:], alone[0].prompt_logprobs[1:]
        assert [p.token_id for p in got] == [p.token_id for p in want]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want)) < 1e-3  # (chunked otherwise: rounding)
    assert_pool_free(eng)


def test_cpu_chunks_are_sized_by_the_time_of_the_last_extend_step(qwen3):
    """On the CPU a long prompt's chunk is what the last extend step's speed makes in the step target (never under
    MIN_TIMED_CHUNK, nor over chunked_prefill_size; FIRST_TIMED_CHUNK before anything was timed): a step in
    progress, which a new request waits for, stays short however long the prefix grows."""
    from minisrv.engine.scheduler.scheduler import FIRST_TIMED_CHUNK, MIN_TIMED_CHUNK
    eng = make_llm(qwen3, chunked_prefill_size=1000).engine
    sched = eng.scheduler
    assert sched.step_target_s is not None and sched.extend_tokens_per_s is None
    assert sched.chunk_size() == FIRST_TIMED_CHUNK
    eng.add_request(make_prompts(vocab_of(qwen3), [40], seed=5)[0], SamplingParams(max_tokens=1))
    while eng.has_work():
        eng.step()
    assert sched.extend_tokens_per_s > 0  # the engine timed the prefill step
    sched.extend_took(300, 1.0)  # 300 tokens a second
    assert sched.chunk_size() == int(300 * sched.step_target_s)
    sched.extend_took(10, 1.0)
    assert sched.chunk_size() == MIN_TIMED_CHUNK
    sched.extend_took(10 ** 6, 1.0)
    assert sched.chunk_size() == 1000
    sched.extend_took(300, 1.0)
    long = eng.add_request(make_prompts(vocab_of(qwen3), [240], seed=6)[0], SamplingParams(max_tokens=1))
    batch = sched.schedule()
    assert batch.extend_lens == [int(300 * sched.step_target_s)] and batch.reqs == [long]
