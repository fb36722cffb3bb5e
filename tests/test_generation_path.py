"""The server's request path in-process, against a scripted engine: what a client sees when the engine fails or
refuses a request, how choices are put together from the engine's text deltas, validation through
SamplingParams/check_request, and the typed messages between the HTTP side and the engine process.

The scripted engine replies with hand-made RequestOutputs, so each expectation here is written out by hand;
tests/test_openai_server.py covers the same paths end to end with the real engine.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import pickle
from typing import Any, Callable, Dict, List, Optional, Sequence

import pytest
import zmq

from minisrv.engine.request import RequestError, RequestOutput, SamplingParams, TokenLogprob
from minisrv.server import engine_proc
from minisrv.server.engine_proc import EngineDead
from minisrv.server.generation import Choice
from minisrv.server.messages import (AbortRequest, AddRequest, EngineInfo, EngineStats, Rejected, Shutdown,
                                     StatsQuery, StepOutputs)
from minisrv.server.app import create_app
from minisrv.server.state import ServerState

from .helpers.local_engine import call, events

VOCAB = 49152
CONTEXT = 8192
CHAT_Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer():
    from minisrv.checkpoints.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="module")
def words(tokenizer) -> List[int]:
    """Two tokens whose texts are ' Hello' and ' world', and the EOS."""
    ids = tokenizer(" Hello world", add_special_tokens=False).input_ids
    assert len(ids) == 2
    return ids + [tokenizer.eos_token_id]


def _lp(tok: int) -> List[TokenLogprob]:
    return [TokenLogprob(tok, -0.25, {tok: -0.25, 0: -2.0})]


def output(rid: str, tok: int, text: str, offset: int, n_out: int, reason: Optional[str] = None,
           logprobs: bool = True) -> RequestOutput:
    return RequestOutput(rid, [tok], text, _lp(tok) if logprobs else [], [offset], reason is not None, reason,
                         num_output_tokens=n_out)


Script = Callable[[str, List[int], SamplingParams], Sequence[Any]]


class ScriptedEngine:
    """Stands in for EngineClient: answers each submitted request with the items its script returns, the first
    after 1 ms and each next spacing_s later (0: all in one wake-up of the event loop, as a busy server's can)."""

    ready, dead = True, False

    def __init__(self, script: Script, spacing_s: float = 0.001) -> None:
        self.script = script
        self.spacing_s = spacing_s
        self.submitted: List[AddRequest] = []
        self.aborted: List[str] = []

    def submit(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, sink: asyncio.Queue,
               tag: Any) -> None:
        self.submitted.append(AddRequest(rid, list(prompt_ids), params))
        loop = asyncio.get_running_loop()
        for k, item in enumerate(self.script(rid, list(prompt_ids), params)):
            loop.call_later(0.001 + self.spacing_s * k, sink.put_nowait, (tag, item))

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def fresh_stats(self, timeout: float = 0.5) -> Dict[str, Any]:
        return {}


def hello_world(words: List[int], fail: Optional[str] = None) -> Script:
    """' Hello', ' world', then EOS (or, with `fail`, the engine fails the request after ' Hello')."""
    hello, world, eos = words

    def script(rid: str, prompt: List[int], params: SamplingParams) -> List[RequestOutput]:
        lp = params.logprobs is not None
        if fail is not None:
            return [output(rid, hello, " Hello", 0, 1, logprobs=lp),
                    RequestOutput(rid, [], "", [], [], True, "error", num_output_tokens=1, error=fail)]
        return [output(rid, hello, " Hello", 0, 1, logprobs=lp), output(rid, world, " world", 6, 2, logprobs=lp),
                output(rid, eos, "", 12, 3, "stop", logprobs=lp)]
    return script


def make_app(tokenizer, engine: ScriptedEngine):
    state = ServerState(client=engine, tokenizer=tokenizer, info=EngineInfo("m.gguf", "torch", "cpu", CONTEXT, CONTEXT,
                                                                            VOCAB), served_model_name="m")
    return state, create_app(state)




def finished(state: ServerState, reason: str) -> float:
    return state.metrics.registry.get_sample_value("minisrv_request_finish_total", {"reason": reason}) or 0.0


# ---------------------------------------------------------------------------------------------- the text path
def test_chat_text_and_logprobs_from_engine_deltas(tokenizer, words) -> None:
    state, app = make_app(tokenizer, ScriptedEngine(hello_world(words)))
    r = call(app, "/v1/chat/completions", {"messages": CHAT_Q, "logprobs": True, "top_logprobs": 1})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["message"]["content"] == " Hello world" and ch["finish_reason"] == "stop"
    # the EOS that ended it is counted, but has no text and no logprobs entry
    assert [t["token"] for t in ch["logprobs"]["content"]] == [" Hello", " world"]
    assert r.json()["usage"]["completion_tokens"] == 3
    assert finished(state, "stop") == 1
    ev = events(call(app, "/v1/chat/completions", {"messages": CHAT_Q, "stream": True,
                                                    "stream_options": {"include_usage": True}}))
    deltas = [c["delta"] for e in ev[:-2] for c in e["choices"]]
    assert [d.get("role") for d in deltas].count("assistant") == 1 and ev[0]["choices"][0]["delta"]["role"]
    assert "".join(d.get("content") or "" for d in deltas) == " Hello world" and ev[-1] == "[DONE]"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 3
    assert all(e.get("usage") is None for e in ev[:-2])


def test_completion_stream_and_echo(tokenizer, words) -> None:
    state, app = make_app(tokenizer, ScriptedEngine(hello_world(words)))
    r = call(app, "/v1/completions", {"prompt": "Say:", "logprobs": 0, "stream": True,
                                      "stream_options": {"include_usage": True}})
    ev = events(r)
    assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 3 and ev[-2]["choices"] == []
    texts = [c["choices"][0]["text"] for c in ev[:-2]]
    assert "".join(texts) == " Hello world" and ev[-3]["choices"][0]["finish_reason"] == "stop"
    offsets = [o for c in ev[:-2] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 6]
    # echo: the prompt text first, as its own chunk when streaming
    r = call(app, "/v1/completions", {"prompt": "Say:", "echo": True})
    assert r.json()["choices"][0]["text"] == "Say: Hello world"
    ev = events(call(app, "/v1/completions", {"prompt": "Say:", "echo": True, "stream": True}))
    assert ev[0]["choices"][0]["text"] == "Say:"
    assert "".join(c["choices"][0]["text"] for c in ev[:-1]) == "Say: Hello world"


def test_choice_offsets_count_the_echoed_prompt(words) -> None:
    hello, world, eos = words
    ch = Choice(0, prefix="Say:")
    ch.feed(output("r", hello, " Hello", 0, 1))
    ch.feed(output("r", world, " world", 6, 2))
    text, lps = ch.feed(output("r", eos, "", 12, 3, "stop"))
    assert text == "" and lps == []
    assert ch.prefix + ch.text == "Say: Hello world" and [o for _, o in ch.logprobs] == [4, 10]
    assert ch.finish_reason == "stop" and ch.num_output_tokens == 3


def test_n_choices_get_consecutive_seeds(tokenizer, words) -> None:
    engine = ScriptedEngine(hello_world(words))
    _, app = make_app(tokenizer, engine)
    r = call(app, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "seed": 10})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert [a.params.seed for a in engine.submitted] == [10, 11, 10, 11]
    engine.submitted.clear()
    r = call(app, "/v1/completions", {"prompt": "a", "n": 2, "seed": 2 ** 63 - 1})
    assert [a.params.seed for a in engine.submitted] == [2 ** 63 - 1, -(2 ** 63)]  # choice seeds wrap in 64 bits
    assert r.json()["usage"]["prompt_tokens"] == sum(len(a.prompt_ids) for a in engine.submitted[::2])


def test_more_choices_do_not_validate_again(tokenizer, words, monkeypatch) -> None:
    """The request's values are checked once whatever n is: a choice's own seed does not re-run the checks."""
    checks: List[int] = []
    validate = SamplingParams.validate

    def counted(self: SamplingParams) -> None:
        checks.append(1)
        validate(self)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    engine = ScriptedEngine(hello_world(words))
    _, app = make_app(tokenizer, engine)
    per_n = {}
    for n in (1, 4):
        checks.clear()
        r = call(app, "/v1/completions", {"prompt": "a", "n": n, "seed": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == n
        per_n[n] = len(checks)
    assert per_n[4] == per_n[1] > 0


# ---------------------------------------------------------------------------------------------- engine failures
def test_engine_failure_non_streaming_is_500(tokenizer, words) -> None:
    engine = ScriptedEngine(hello_world(words, fail="RuntimeError: boom"))
    state, app = make_app(tokenizer, engine)
    r = call(app, "/v1/chat/completions", {"messages": CHAT_Q, "n": 2})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "RuntimeError: boom" in err["message"]
    assert finished(state, "error") == 1 and finished(state, "abort") == 1  # the other choice is dropped
    assert len(engine.aborted) == 1


@pytest.mark.parametrize("spacing_s", [0.001, 0.0], ids=["apart", "one-wake-up"])
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": CHAT_Q}),
                                       ("/v1/completions", {"prompt": "Hi"})])
def test_engine_failure_streaming_ends_with_error_event(tokenizer, words, path: str, body: Dict[str, Any],
                                                        spacing_s: float) -> None:
    """The text before the failure is streamed, then the error event, whether the two came apart or together."""
    state, app = make_app(tokenizer, ScriptedEngine(hello_world(words, fail="RuntimeError: boom"), spacing_s))
    r = call(app, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    ev = events(r)
    text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for e in ev[:-2] for c in e["choices"])
    assert text == " Hello", ev
    assert ev[-1] == "[DONE]"
    err = ev[-2]["error"]
    assert err["type"] == "server_error" and "boom" in err["message"]
    assert not any("usage" in e and e.get("usage") for e in ev[:-2] if isinstance(e, dict))
    assert finished(state, "error") == 1


def test_engine_refusal_and_death(tokenizer, words) -> None:
    """Before a stream's first output a refusal or the engine's death is the HTTP error of the same request
    unstreamed (no stream bytes sent); after it, the stream's last event."""
    refused = ScriptedEngine(lambda rid, p, sp: [RequestError("duplicate request id", "rid", "duplicate")])
    state, app = make_app(tokenizer, refused)
    r = call(app, "/v1/completions", {"prompt": "Hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid" and r.json()["error"]["code"] == "duplicate"
    assert finished(state, "error") == 1
    s = call(app, "/v1/completions", {"prompt": "Hi", "stream": True})
    assert s.status_code == 400 and s.json() == r.json()
    _, app = make_app(tokenizer, ScriptedEngine(lambda rid, p, sp: [EngineDead("the engine process died")]))
    r = call(app, "/v1/completions", {"prompt": "Hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    s = call(app, "/v1/completions", {"prompt": "Hi", "stream": True})
    assert s.status_code == 503 and s.json() == r.json()
    hello = words[0]
    _, app = make_app(tokenizer, ScriptedEngine(lambda rid, p, sp: [output(rid, hello, " Hello", 0, 1),
                                                                    EngineDead("the engine process died")]))
    s = call(app, "/v1/completions", {"prompt": "Hi", "stream": True})
    ev = events(s)
    assert s.status_code == 200 and ev[0]["choices"][0]["text"] == " Hello"
    assert ev[-2]["error"]["code"] == "engine_unavailable" and ev[-1] == "[DONE]"


def test_a_client_gone_before_the_first_output_aborts_its_stream(tokenizer) -> None:
    """A stream waiting for its request's first output (queued, or its grammar compiling) sends nothing yet; a
    client that leaves meanwhile gets its engine requests aborted, every choice of them."""
    engine = ScriptedEngine(lambda rid, p, sp: [])  # the engine never answers
    state, app = make_app(tokenizer, engine)
    sent: List[Dict[str, Any]] = []
    body = json.dumps({"prompt": "Hi", "n": 2, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message: Dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"t"), (b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("t", 80)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert sorted(engine.aborted) == sorted(a.rid for a in engine.submitted) and len(engine.aborted) == 2
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert finished(state, "abort") == 2


# ---------------------------------------------------------------------------------------------- validation
BAD = [
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature", None),
    ("/v1/completions", {"prompt": "Hi", "top_k": VOCAB + 1}, "top_k", None),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty", None),
    ("/v1/completions", {"prompt": "Hi", "seed": 2 ** 63}, "seed", None),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [VOCAB]}, "stop_token_ids", None),
    ("/v1/completions", {"prompt": [[5], [VOCAB]]}, "prompt", None),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": CONTEXT}, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [1] * CONTEXT, "max_tokens": None}, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": CHAT_Q, "max_completion_tokens": 0}, "max_completion_tokens", None),
    ("/v1/chat/completions", {"messages": CHAT_Q, "max_tokens": 0}, "max_tokens", None),
    ("/v1/chat/completions", {"messages": CHAT_Q, "max_tokens": CONTEXT}, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * CONTEXT}]}, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": CHAT_Q, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT_Q, "stop": ["x"] * 65}, "stop", None),
]


@pytest.mark.parametrize("path,body,param,code", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_values_are_checked_before_the_engine(tokenizer, words, path: str, body: Dict[str, Any], param: str,
                                              code: Optional[str]) -> None:
    engine = ScriptedEngine(hello_world(words))
    _, app = make_app(tokenizer, engine)
    r = call(app, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code, err
    assert engine.submitted == []


# ---------------------------------------------------------------------------------------------- messages
class FakeSocket:
    """The engine side's pipes: the loop reads one batch of `batches` per turn; `sent` collects what it sends."""

    def __init__(self, *batches: List[Any]) -> None:
        self.batches, self.sent = [list(b) for b in batches], []

    def poll(self, timeout: int = 0) -> bool:
        return bool(self.batches)

    def recv_pyobj(self, flags: int = 0) -> Any:
        if not self.batches[0]:
            self.batches.pop(0)
            raise zmq.Again()
        return self.batches[0].pop(0)

    def send_pyobj(self, obj: Any) -> None:
        self.sent.append(obj)


class RefusingEngine:
    """Refuses rid 'dup' as the real engine refuses a duplicate id; anything else can be aborted."""

    staged_kernels = None  # every kernel it asked for serves

    def has_work(self) -> bool:
        return False

    def make_request(self, prompt_ids: List[int], params: SamplingParams, rid: str) -> Any:
        return rid

    def add(self, rid: str) -> None:
        if rid == "dup":
            raise RequestError("duplicate request id 'dup'", "rid", "duplicate_id")

    def abort(self, rid: str) -> Optional[RequestOutput]:
        return RequestOutput(rid, [], "", [], [], True, "abort")

    def stats(self) -> Dict[str, Any]:
        return {"num_running": 0}


def test_engine_loop_dispatches_typed_messages() -> None:
    sock = FakeSocket([AddRequest("dup", [1, 2], SamplingParams()), AbortRequest("a"), StatsQuery()], [Shutdown()])
    engine_proc._loop(RefusingEngine(), sock, sock, os.getppid())
    assert gc.get_freeze_count() == 0  # the heap is frozen by the engine process's main only (on_started)
    rejected, step, stats = sock.sent
    assert rejected == Rejected("dup", "duplicate request id 'dup'", "rid", "duplicate_id")
    assert isinstance(step, StepOutputs) and [(o.rid, o.finish_reason) for o in step.outputs] == [("a", "abort")]
    assert stats == EngineStats({"num_running": 0})


def test_client_turns_a_rejection_into_the_request_error() -> None:
    from minisrv.config import EngineConfig

    class Replies:
        """The engine's messages, pickled, as the client's zmq.asyncio socket answers recv (never, once they are
        all read, unless not to wait)."""

        def __init__(self, msgs: List[Any]) -> None:
            self.msgs = [pickle.dumps(m) for m in msgs]

        def recv(self, flags: int = 0) -> asyncio.Future:
            answer = asyncio.get_running_loop().create_future()
            if self.msgs:
                answer.set_result(self.msgs.pop(0))
            elif flags & zmq.NOBLOCK:
                answer.set_exception(zmq.Again())
            return answer

    async def run() -> Any:
        client = engine_proc.EngineClient(EngineConfig())
        try:
            client.ready = True
            sink: asyncio.Queue = asyncio.Queue()
            client.submit("r1", [1], SamplingParams(), sink, 7)
            client._recv = Replies([Rejected("r1", "no", "prompt", "bad"), EngineStats({"num_waiting": 3})])
            task = asyncio.create_task(client._recv_loop())
            tag, err = await asyncio.wait_for(sink.get(), 5)
            await asyncio.sleep(0.01)
            task.cancel()
            return tag, err, client.stats
        finally:
            os.rmdir(client._dir)

    tag, err, stats = asyncio.run(run())
    assert tag == 7 and isinstance(err, RequestError) and (str(err), err.param, err.code) == ("no", "prompt", "bad")
    assert stats == {"num_waiting": 3}
