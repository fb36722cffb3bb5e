"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) against what the same request gives on the
chat path and against the tokenizer's own count of the templated prompt.

In-process (helpers/local_engine.py) on the tiny Qwen2 with a tool-calling template (forced calls via tool_choice)
and the tiny Qwen3 with <think> (a thinking block and the budget); one slow test runs the official `anthropic`
client against a real server process with --api-key. The weights are random, so the text is noise: each check
compares two ways of getting the same tokens (greedy), never the text with itself.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, List

import pytest

from minisrv.server.anthropic.routes import CountTokensRequest, chat_inputs
from minisrv.server.errors import APIError
from minisrv.server.messages import EngineInfo
from minisrv.server.app import create_app
from minisrv.server.state import ServerState

from minisrv.server.anthropic.render import MessageRenderer
from minisrv.server.generation import Choice
from minisrv.server.openai.protocol import UsageInfo
from minisrv.server.plan.tools import plan_tools

from .helpers.local_engine import LocalEngine, call, events_of
from .test_generation_path import ScriptedEngine, hello_world, tokenizer, words  # noqa: F401 - fixtures
from .test_generation_path import make_app as make_scripted_app

httpx = pytest.importorskip("httpx")

WEATHER = {"name": "get_weather", "description": "Get the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                              "days": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}},
                            "required": ["city", "days"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCE = {"type": "tool", "name": "get_weather"}


def engine_of(path: str):
    from minisrv.engine.engine import Engine
    return Engine(model=path, attention_backend="torch", dtype="float32", log_level="warning",
                  max_total_tokens=4096)


def app_of(engine: Any, **state: Any):
    tok = copy.deepcopy(engine.parts.tokenizer)
    return create_app(ServerState(client=LocalEngine(engine), tokenizer=tok, served_model_name="m",
                                  info=EngineInfo.from_engine(engine), **state)), tok


@pytest.fixture(scope="module")
def qwen2_engine(tiny_qwen2_tools):
    return engine_of(tiny_qwen2_tools)


@pytest.fixture(scope="module")
def qwen2(qwen2_engine):
    return app_of(qwen2_engine)


def msg(app: Any, **body: Any) -> httpx.Response:
    return call(app, "/v1/messages", {"model": "m", "max_tokens": 12, "messages": ASK, "temperature": 0, **body})


def chat(app: Any, **body: Any) -> Dict[str, Any]:
    r = call(app, "/v1/chat/completions", {"model": "m", "max_tokens": 12, "messages": ASK, "temperature": 0,
                                           **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(r: httpx.Response) -> List[Dict[str, Any]]:
    """Named events: each `event:` line must name its data's type."""
    out = []
    for part in r.text.split("\n\n"):
        if not part.strip():
            continue
        name, data = part.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), part
        ev = json.loads(data[len("data: "):])
        assert ev["type"] == name[len("event: "):]
        out.append(ev)
    return out


def assembled(evs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A stream put back together as the SDK does: the message, its blocks from their deltas, the final delta."""
    assert evs[0]["type"] == "message_start" and evs[-1]["type"] == "message_stop"
    message = evs[0]["message"]
    assert message["content"] == [] and message["stop_reason"] is None
    blocks: List[Dict[str, Any]] = []
    json_bufs: Dict[int, str] = {}
    open_block = None
    for ev in evs[1:-1]:
        if ev["type"] == "content_block_start":
            assert open_block is None and ev["index"] == len(blocks)
            open_block = ev["index"]
            blocks.append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            assert ev["index"] == open_block
            d, b = ev["delta"], blocks[ev["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[d["type"]]
            if key == "partial_json":
                json_bufs[ev["index"]] = json_bufs.get(ev["index"], "") + d[key]
            else:
                b[key] += d[key]
        elif ev["type"] == "content_block_stop":
            assert ev["index"] == open_block
            if open_block in json_bufs:
                blocks[open_block]["input"] = json.loads(json_bufs[open_block])
            open_block = None
        elif ev["type"] == "message_delta":
            assert open_block is None
            message.update(ev["delta"])
            message["usage"]["output_tokens"] = ev["usage"]["output_tokens"]
        else:
            assert ev["type"] == "ping"
    message["content"] = blocks
    return message


def prompt_len(tok: Any, messages: List[Dict[str, Any]], **kw: Any) -> int:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    return len(tok(text, add_special_tokens=False).input_ids)


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and "message" in body["error"], body
    return body["error"]["message"]


# ---------------------------------------------------------------------------------------------- conversion
def test_conversion_chat_inputs() -> None:
    body = CountTokensRequest.model_validate({"system": [{"type": "text", "text": "Be"}, {"type": "text",
                                                                                          "text": "brief."}],
                                              "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "42"}]},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no",
                                      "is_error": True},
                                     {"type": "text", "text": "Thanks"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"},
        "thinking": {"type": "enabled", "budget_tokens": 5}})
    chat_in = chat_inputs(body, reasoning_parser=True)
    assert chat_in.messages == [
        {"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "42"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no"},
        {"role": "user", "content": "Thanks"}]
    assert chat_in.tools == [{"type": "function", "function": {"name": "f", "description": "",
                                                               "parameters": {"type": "object"}}}]
    assert chat_in.tool_choice == "required"
    assert (chat_in.template_kwargs, chat_in.thinking_budget) == ({"enable_thinking": True}, 5)
    assert chat_inputs(body, reasoning_parser=False).template_kwargs == {}  # a model that does not think: ignored
    for choice, want in [({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                         ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}})]:
        assert chat_inputs(body.model_copy(update={"tool_choice": choice}), False).tool_choice == want
    for content in ([{"type": "image", "source": {}}], [{"type": "tool_use", "id": "x", "name": "f", "input": {}}],
                    [{"text": "no type"}]):
        with pytest.raises(APIError):
            chat_inputs(CountTokensRequest.model_validate({"messages": [{"role": "user", "content": content}]}), False)


# ---------------------------------------------------------------------------------------------- text
@pytest.mark.slow
def test_text_message_and_stream_match_chat(qwen2) -> None:
    app, tok = qwen2
    want = chat(app, messages=[{"role": "system", "content": "Be brief."}] + ASK)
    r = msg(app, system="Be brief.", metadata={"user_id": "u"})
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["id"].startswith("msg_") and (m["type"], m["role"], m["model"]) == ("message", "assistant", "m")
    assert m["content"] == [{"type": "text", "text": want["choices"][0]["message"]["content"]}]
    assert m["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[want["choices"][0]["finish_reason"]]
    assert m["stop_sequence"] is None
    assert m["usage"] == {"input_tokens": prompt_len(tok, [{"role": "system", "content": "Be brief."}] + ASK),
                          "output_tokens": want["usage"]["completion_tokens"]}
    s = msg(app, system="Be brief.", stream=True)
    assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
    streamed = assembled(sse(s))
    assert {k: v for k, v in streamed.items() if k != "id"} == {k: v for k, v in m.items() if k != "id"}


def test_stop_reasons(qwen2) -> None:
    app, _ = qwen2
    text = msg(app, max_tokens=3).json()
    assert text["stop_reason"] == "max_tokens" and text["usage"]["output_tokens"] == 3
    said = text["content"][0]["text"]
    stop = said[len(said) // 2:][:3]  # a piece of the greedy output: generation stops at it
    assert stop.strip()
    for r in (msg(app, stop_sequences=[stop]).json(), assembled(sse(msg(app, stop_sequences=[stop], stream=True)))):
        assert (r["stop_reason"], r["stop_sequence"]) == ("stop_sequence", stop)
        assert r["content"][0]["text"] == said[:said.find(stop)]


# ---------------------------------------------------------------------------------------------- tools
@pytest.mark.slow
def test_forced_tool_use_round_trip(qwen2) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    app, tok = qwen2
    r = msg(app, max_tokens=200, tools=[WEATHER], tool_choice=FORCE)
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["stop_reason"] == "tool_use"
    (use,) = [b for b in m["content"] if b["type"] == "tool_use"]
    assert use["id"].startswith("toolu_") and use["name"] == "get_weather"
    jsonschema.validate(use["input"], WEATHER["input_schema"])
    streamed = assembled(sse(msg(app, max_tokens=200, tools=[WEATHER], tool_choice=FORCE, stream=True)))
    assert streamed["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("name"), b.get("input")) for b in streamed["content"]] == \
        [(b["type"], b.get("name"), b.get("input")) for b in m["content"]]
    # the call and its result go back: the prompt is chat's with the assistant's tool_calls and a tool message
    second = ASK + [{"role": "assistant", "content": m["content"]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                  "content": "Sunny, 21C"}]}]
    as_chat = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": use["id"], "type": "function", "function": {"name": "get_weather", "arguments": use["input"]}}]},
                     {"role": "tool", "tool_call_id": use["id"], "content": "Sunny, 21C"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    count = call(app, "/v1/messages/count_tokens", {"model": "m", "messages": second, "tools": [WEATHER]})
    assert count.status_code == 200, count.text
    assert count.json() == {"input_tokens": prompt_len(tok, as_chat, tools=tools)}
    text = tok.apply_chat_template(as_chat, add_generation_prompt=True, tokenize=False, tools=tools)
    assert "<tool_response>\nSunny, 21C\n</tool_response>" in text and '"name": "get_weather"' in text
    again = msg(app, messages=second, tools=[WEATHER])
    assert again.status_code == 200 and again.json()["usage"]["input_tokens"] == count.json()["input_tokens"]


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("body,status,kind", [
    ({"max_tokens": None}, 400, "invalid_request_error"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request_error"),
    ({"model": "nope"}, 404, "not_found_error"),
    ({"temperature": -1}, 400, "invalid_request_error"),
    ({"tool_choice": {"type": "tool", "name": "other"}, "tools": [WEATHER]}, 400, "invalid_request_error"),
])
def test_errors_in_anthropic_shape(qwen2, body: Dict[str, Any], status: int, kind: str) -> None:
    app, _ = qwen2
    full = {"model": "m", "max_tokens": 4, "messages": ASK, **body}
    anthropic_error(call(app, "/v1/messages", {k: v for k, v in full.items() if v is not None}), status, kind)
    assert msg(app, max_tokens=2).status_code == 200  # and it keeps serving


def test_api_key_and_shapes_by_path(qwen2_engine) -> None:
    import asyncio
    app, _ = app_of(qwen2_engine, api_key="sekret")

    async def post(path: str, headers: Dict[str, str]) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as h:
            return await h.post(path, headers=headers, timeout=60,
                                json={"model": "m", "max_tokens": 2, "messages": ASK})

    def run(path: str, headers: Dict[str, str]) -> httpx.Response:
        return asyncio.run(post(path, headers))

    anthropic_error(run("/v1/messages", {"x-api-key": "wrong"}), 401, "authentication_error")
    anthropic_error(run("/v1/messages/count_tokens", {}), 401, "authentication_error")
    assert run("/v1/messages", {"x-api-key": "sekret", "anthropic-version": "2023-06-01"}).status_code == 200
    assert run("/v1/messages", {"Authorization": "Bearer sekret"}).status_code == 200
    assert run("/v1/messages/count_tokens", {"x-api-key": "sekret"}).json()["input_tokens"] > 0
    openai = run("/v1/chat/completions", {"x-api-key": "wrong"})  # the rest keeps OpenAI's shape
    assert openai.status_code == 401 and openai.json()["error"]["code"] == "invalid_api_key"
    assert run("/v1/chat/completions", {"x-api-key": "sekret"}).status_code == 200


@pytest.mark.parametrize("spacing_s", [0.001, 0.0], ids=["apart", "one-wake-up"])
def test_engine_failure_before_and_after_the_stream_began(tokenizer, words, spacing_s) -> None:  # noqa: F811
    """The engine fails the request after ' Hello': a 500 api_error, or (streamed) the text so far, then an error
    event in Anthropic's shape and no message_stop; the same where ' Hello' and the failure come in one wake-up."""
    state, app = make_scripted_app(tokenizer, ScriptedEngine(hello_world(words, fail="boom"), spacing_s))
    anthropic_error(call(app, "/v1/messages", {"max_tokens": 5, "messages": ASK}), 500, "api_error")
    evs = sse(call(app, "/v1/messages", {"max_tokens": 5, "messages": ASK, "stream": True}))
    assert [e["type"] for e in evs] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                        "error"]
    assert evs[3]["delta"] == {"type": "text_delta", "text": " Hello"}
    assert evs[-1]["error"]["type"] == "api_error" and "boom" in evs[-1]["error"]["message"]
    anthropic_error(call(app, "/v1/messages/batches", {}), 404, "not_found_error")  # any path under it
    counted = state.metrics.registry.get_sample_value("minisrv_requests_total",
                                                      {"endpoint": "/v1/messages", "status": "500"})
    assert counted == 1


def test_streamed_auto_tool_call_is_the_whole_ones() -> None:
    """tool_choice auto: a Hermes call after some text, fed in pieces that cut the tags; the stream's blocks are
    the whole message's (the text's trailing space aside, as in chat's stream), and the text before the call is
    shown before the output ends."""
    plan = plan_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "auto")
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>'
    whole = MessageRenderer("m", 7, plan).response([Choice(0, text=text, finish_reason="stop",
                                                          num_output_tokens=30)], UsageInfo())
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"] and whole["stop_reason"] == "tool_use"
    assert whole["content"][0]["text"] == "Sure." and whole["content"][1]["input"] == {"x": [1, 2]}
    r, ch = MessageRenderer("m", 7, plan), Choice(0, num_output_tokens=30)
    evs = events_of(r.opening(ch))
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        ch.text += piece
        evs += events_of(r.chunks(ch, piece, [], "stop" if last else None))
        if k == 3:
            shown = "".join(e["delta"].get("text", "") for e in evs if e["type"] == "content_block_delta")
            assert shown == "Sure. "  # shown before the output ends; the possible call held back
    got = assembled(evs)
    assert got["stop_reason"] == "tool_use" and got["usage"] == {"input_tokens": 7, "output_tokens": 30}
    assert [b["type"] for b in got["content"]] == ["text", "tool_use"]
    assert got["content"][0]["text"].strip() == "Sure."
    (a, b) = (dict(got["content"][1]), dict(whole["content"][1]))
    assert a.pop("id").startswith("toolu_") and b.pop("id").startswith("toolu_") and a == b


# ---------------------------------------------------------------------------------------------- thinking
@pytest.mark.slow
def test_thinking_block_matches_chat_reasoning(tiny_qwen3_thinking) -> None:
    engine = engine_of(tiny_qwen3_thinking)
    app, tok = app_of(engine, reasoning_parser="auto")
    want = chat(app, max_tokens=20, thinking_budget=3)["choices"][0]["message"]
    m = msg(app, max_tokens=20, thinking={"type": "enabled", "budget_tokens": 3}).json()
    blocks = [(b["type"], b.get("thinking", b.get("text"))) for b in m["content"]]
    expect = ([("thinking", want["reasoning_content"])] if want.get("reasoning_content") else []) + \
        ([("text", want["content"])] if want["content"] else [])
    assert blocks == (expect or [("text", "")])
    streamed = assembled(sse(msg(app, max_tokens=20, thinking={"type": "enabled", "budget_tokens": 3}, stream=True)))
    assert streamed["content"] == m["content"]
    off = msg(app, max_tokens=8, thinking={"type": "disabled"}).json()
    assert off["usage"]["input_tokens"] == prompt_len(tok, ASK, enable_thinking=False)
    assert all(b["type"] == "text" for b in off["content"])
    # without a reasoning parser, "enabled" is ignored (no budget asked of a model that does not think)
    plain, _ = app_of(engine)
    assert msg(plain, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 3}).status_code == 200


# ---------------------------------------------------------------------------------------------- real client
@pytest.mark.slow
def test_anthropic_client_against_a_server(tiny_qwen2_tools) -> None:
    anthropic = pytest.importorskip("anthropic")
    jsonschema = pytest.importorskip("jsonschema")
    from transformers import AutoTokenizer

    from .helpers.server_process import running

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_tools)
    with running("--model", tiny_qwen2_tools, "--api-key", "sekret") as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="sekret", max_retries=0, timeout=300)
        model = httpx.get(srv.url + "/v1/models", headers={"x-api-key": "sekret"}).json()["data"][0]["id"]
        # greedy: through extra_body, as this SDK's create() no longer takes temperature
        kw: Dict[str, Any] = dict(model=model, max_tokens=10, messages=ASK, extra_body={"temperature": 0.0})
        m = client.messages.create(**kw)
        assert m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text"
        assert m.usage.input_tokens == prompt_len(tok, ASK)
        assert m.usage.output_tokens == len(tok(m.content[0].text, add_special_tokens=False).input_ids) + \
            (m.stop_reason == "end_turn")  # the EOS that ended it counts but has no text
        with client.messages.stream(**kw) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == final.content[0].text == m.content[0].text and final.usage == m.usage
        forced = client.messages.create(**{**kw, "max_tokens": 200}, tools=[WEATHER], tool_choice=FORCE)
        assert forced.stop_reason == "tool_use"
        use = next(b for b in forced.content if b.type == "tool_use")
        jsonschema.validate(use.input, WEATHER["input_schema"])
        with client.messages.stream(**{**kw, "max_tokens": 200}, tools=[WEATHER], tool_choice=FORCE) as stream:
            streamed = stream.get_final_message()
        assert streamed.stop_reason == "tool_use"
        assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]
        second = ASK + [{"role": "assistant", "content": [b.model_dump() for b in forced.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": "Sunny"}]}]
        counted = client.messages.count_tokens(model=model, messages=second, tools=[WEATHER]).input_tokens
        answer = client.messages.create(**{**kw, "messages": second}, tools=[WEATHER])
        assert answer.usage.input_tokens == counted > m.usage.input_tokens
        bad: List[Any] = [dict(kw, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                          dict(kw, messages=[{"role": "robot", "content": "x"}]), dict(kw, model="nope")]
        for body, error in zip(bad, (anthropic.BadRequestError, anthropic.BadRequestError, anthropic.NotFoundError)):
            with pytest.raises(error) as e:
                client.messages.create(**body)
            assert e.value.body["type"] == "error"
        headers = {"x-api-key": "sekret", "anthropic-version": "2023-06-01"}
        no_max = httpx.post(srv.url + "/v1/messages", json={"model": model, "messages": ASK}, headers=headers)
        anthropic_error(no_max, 400, "invalid_request_error")
        assert "max_tokens" in no_max.json()["error"]["message"]
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(**kw)
        assert e.value.body["error"]["type"] == "authentication_error"
        assert client.messages.create(**kw).content == m.content  # still serving
