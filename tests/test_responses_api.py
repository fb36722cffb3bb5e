"""POST /v1/responses (OpenAI's Responses API) against the chat endpoint it is built on, on real engines.

The judge of each answer is the chat endpoint's answer to the same greedy conversation (the Responses request turned
into chat by hand here), jsonschema for structured outputs and forced calls, and the openai client's own pydantic
models for every shape (each streamed event is validated as a `ResponseStreamEvent`, each response as a `Response`).
In process: a tiny Qwen2 with a tool-calling template (helpers/tiny_qwen2.py) and a tiny Qwen3 with a DeepSeek-R1
template (thinking, split by the reasoning parser). The slow tests run a real server and the real openai client:
`responses.create`, `responses.stream`, a forced call and its output sent back, and the 400s.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, List

import pydantic
import pytest

from minisrv.server.messages import EngineInfo
from minisrv.server.generation import Choice
from minisrv.server.openai.protocol import UsageInfo
from minisrv.server.plan.tools import plan_tools
from minisrv.server.responses.routes import ResponsesRequest, chat_inputs, echo_fields
from minisrv.server.responses.render import ResponseRenderer
from minisrv.server.app import create_app
from minisrv.server.state import ServerState

from .helpers.local_engine import LocalEngine, call
from .helpers.tiny_qwen3_thinking import DEEPSEEK_TEMPLATE

jsonschema = pytest.importorskip("jsonschema")

openai_types = pytest.importorskip("openai.types.responses")

ASK = "What is the weather in Paris for the next 3 days?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                          "required": ["city", "days"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
STREAM_EVENT = pydantic.TypeAdapter(openai_types.ResponseStreamEvent)


def _engine(path: str):
    from minisrv.engine.engine import Engine
    return Engine(model=path, attention_backend="torch", dtype="float32", log_level="warning", max_total_tokens=4096)


@pytest.fixture(scope="module")
def qwen2_engine(tiny_qwen2_tools):
    return _engine(tiny_qwen2_tools)


@pytest.fixture(scope="module")
def qwen2(qwen2_engine):
    engine = qwen2_engine
    return create_app(ServerState(client=LocalEngine(engine), tokenizer=engine.parts.tokenizer, served_model_name="m",
                                  info=EngineInfo.from_engine(engine)))


@pytest.fixture(scope="module")
def r1(tiny_qwen3_thinking):
    engine = _engine(tiny_qwen3_thinking)
    tok = copy.deepcopy(engine.parts.tokenizer)
    tok.chat_template = DEEPSEEK_TEMPLATE
    return create_app(ServerState(client=LocalEngine(engine), tokenizer=tok, served_model_name="m",
                                  info=EngineInfo.from_engine(engine), reasoning_parser="auto"))


def respond(app: Any, **body: Any) -> Dict[str, Any]:
    r = call(app, "/v1/responses", {"temperature": 0, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    openai_types.Response.model_validate(out)  # the client's model of a response takes it
    return out


def chat(app: Any, **body: Any) -> Dict[str, Any]:
    r = call(app, "/v1/chat/completions", {"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(text: str) -> List[Dict[str, Any]]:
    """A Responses stream's events: each `event: <type>` line must name its data's type."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append(data)
    return out


def streamed(app: Any, **body: Any) -> List[Dict[str, Any]]:
    r = call(app, "/v1/responses", {"temperature": 0, "stream": True, **body})
    assert r.status_code == 200, r.text
    evs = sse(r.text)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    for e in evs:
        STREAM_EVENT.validate_python(e)
    return evs


def output_text(resp: Dict[str, Any]) -> str:
    return "".join(p["text"] for item in resp["output"] if item["type"] == "message" for p in item["content"])


# ---------------------------------------------------------------------------------------------- conversion
def test_items_become_chat_messages() -> None:
    req = ResponsesRequest.model_validate({
        "instructions": "Be brief.", "max_output_tokens": 9, "text": {"format": {"type": "json_object"}},
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "input": [{"role": "developer", "content": "Use tools."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})
    body = chat_inputs(req)
    assert body.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert body.tools == [CHAT_WEATHER] and body.sampling["max_tokens"] == 9
    assert body.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert body.sampling["json_object"] is True


# ---------------------------------------------------------------------------------------------- events by hand
def test_events_of_a_message_then_calls() -> None:
    """An output by hand (an answer, then two hermes tool calls), fed in pieces -> the Responses events."""
    tools = [CHAT_WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    plan = plan_tools(tools, "auto")
    r = ResponseRenderer("m", echo_fields(ResponsesRequest(input="x")), lambda text: len(text.split()), plan, None)
    calls = "".join(f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
                    for name, args in [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])
    ch = Choice(0, num_output_tokens=7)
    framed = r.opening(ch)
    for k, piece in enumerate(["Let me ", "check.", calls]):
        ch.text += piece
        framed += r.chunks(ch, piece, [], "stop" if k == 2 else None)
    framed += r.closing(UsageInfo(prompt_tokens=5, completion_tokens=7, total_tokens=12))
    evs = sse("".join(framed))
    for e in evs:
        STREAM_EVENT.validate_python(e)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"] + [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"] * 2 + ["response.completed"]
    done = evs[-1]["response"]
    openai_types.Response.model_validate(done)
    assert [o["type"] for o in done["output"]] == ["message", "function_call", "function_call"]
    assert output_text(done) == "Let me check." and done["status"] == "completed"
    assert [(o["name"], o["arguments"]) for o in done["output"][1:]] == [("get_weather", '{"city": "Oslo"}'),
                                                                         ("get_time", "{}")]
    assert all(o["call_id"].startswith("call_") for o in done["output"][1:])
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert done["usage"]["input_tokens"] == 5 and done["usage"]["output_tokens"] == 7


class FailingEngine(LocalEngine):
    """Fails every request in the engine after its first output (what run_jobs turns into a 500 / error event)."""

    def submit(self, rid, prompt_ids, params, sink, tag) -> None:
        from minisrv.engine.request import RequestOutput
        sink.put_nowait((tag, RequestOutput(rid, [7], " Hi", [], [0], False, None, num_output_tokens=1)))
        sink.put_nowait((tag, RequestOutput(rid, [], "", [], [], True, "error", num_output_tokens=1,
                                            error="boom")))


def test_a_failure_after_the_stream_began_is_an_error_event(qwen2_engine) -> None:
    state = ServerState(client=FailingEngine(None), tokenizer=qwen2_engine.parts.tokenizer, served_model_name="m",
                        info=EngineInfo.from_engine(qwen2_engine))
    app = create_app(state)
    r = call(app, "/v1/responses", {"input": ASK, "stream": True})
    evs = sse(r.text)
    assert [e["type"] for e in evs][:2] == ["response.created", "response.in_progress"]
    assert evs[-1]["type"] == "error" and "boom" in evs[-1]["message"] and evs[-1]["error"]["type"] == "server_error"
    assert not any(e["type"] == "response.completed" for e in evs)
    assert call(app, "/v1/responses", {"input": ASK}).status_code == 500


# ---------------------------------------------------------------------------------------------- in process
def test_string_input_is_the_chat_answer(qwen2) -> None:
    resp = respond(qwen2, input=ASK, instructions="Be brief.", max_output_tokens=12, metadata={"k": "v"})
    ref = chat(qwen2, max_tokens=12, messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": ASK}])
    assert resp["id"].startswith("resp_") and resp["object"] == "response" and resp["model"] == "m"
    assert output_text(resp) == ref["choices"][0]["message"]["content"]
    assert resp["output"][0]["id"].startswith("msg_") and resp["output"][0]["role"] == "assistant"
    u, ru = resp["usage"], ref["usage"]
    assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == \
        (ru["prompt_tokens"], ru["completion_tokens"], ru["total_tokens"])
    assert u["output_tokens_details"]["reasoning_tokens"] == 0
    # cut off by max_output_tokens (random weights rarely stop within 12 tokens): incomplete, and said why
    if ref["choices"][0]["finish_reason"] == "length":
        assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["instructions"] == "Be brief." and resp["max_output_tokens"] == 12 and resp["store"] is False
    assert resp["metadata"] == {"k": "v"} and resp["tool_choice"] == "auto" and resp["tools"] == []


def test_json_schema_format(qwen2) -> None:
    resp = respond(qwen2, input=ASK, max_output_tokens=200,
                   text={"format": {"type": "json_schema", "name": "yn", "schema": SCHEMA, "strict": True}})
    assert resp["status"] == "completed"
    jsonschema.validate(json.loads(output_text(resp)), SCHEMA)


@pytest.mark.slow
def test_forced_call_and_its_output_sent_back(qwen2) -> None:
    resp = respond(qwen2, input=ASK, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                   max_output_tokens=300)
    (item,) = resp["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "completed"
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    jsonschema.validate(json.loads(item["arguments"]), WEATHER["parameters"])
    # the call and its result, sent back: the same answer as chat's for the same conversation
    again = respond(qwen2, tools=[WEATHER], max_output_tokens=10, input=[
        {"role": "user", "content": ASK}, {k: item[k] for k in ("type", "call_id", "name", "arguments")},
        {"type": "function_call_output", "call_id": item["call_id"], "output": "Sunny, 24 C"}])
    call_msg = {"id": item["call_id"], "type": "function",
                "function": {"name": "get_weather", "arguments": item["arguments"]}}
    ref = chat(qwen2, tools=[CHAT_WEATHER], max_tokens=10, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": "", "tool_calls": [call_msg]},
        {"role": "tool", "tool_call_id": item["call_id"], "content": "Sunny, 24 C"}])
    assert again["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    ref_msg = ref["choices"][0]["message"]
    assert output_text(again) == (ref_msg["content"] or "")
    assert [i["arguments"] for i in again["output"] if i["type"] == "function_call"] == \
        [c["function"]["arguments"] for c in ref_msg.get("tool_calls") or []]


def test_stream_matches_the_whole_response(qwen2) -> None:
    whole = respond(qwen2, input=ASK, max_output_tokens=16)
    evs = streamed(qwen2, input=ASK, max_output_tokens=16)
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert text == output_text(whole) == evs[-4]["text"]
    done = evs[-1]["response"]
    assert done["id"] == evs[0]["response"]["id"] and output_text(done) == text
    assert done["usage"] == whole["usage"] and done["status"] == whole["status"]


def test_streamed_forced_call(qwen2) -> None:
    evs = streamed(qwen2, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=300)
    kinds = [e["type"] for e in evs]
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    added = [e["item"] for e in evs if e["type"] == "response.output_item.added"]
    finals = evs[-1]["response"]["output"]
    assert [a["id"] for a in added] == [f["id"] for f in finals] and all(f["type"] == "function_call" for f in finals)
    for f in finals:
        deltas = "".join(e["delta"] for e in evs
                         if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == f["id"])
        assert deltas == f["arguments"]
        jsonschema.validate(json.loads(f["arguments"]), WEATHER["parameters"])


@pytest.mark.slow
def test_reasoning_item(r1) -> None:
    resp = respond(r1, input="What is the capital of France?", max_output_tokens=30)
    ref = chat(r1, max_tokens=30, messages=[{"role": "user", "content": "What is the capital of France?"}])
    msg = ref["choices"][0]["message"]
    assert msg["reasoning_content"]  # the template opened the thinking
    first = resp["output"][0]
    assert first["type"] == "reasoning" and first["id"].startswith("rs_") and first["summary"] == []
    assert first["content"] == [{"type": "reasoning_text", "text": msg["reasoning_content"]}]
    assert output_text(resp) == (msg["content"] or "")
    assert 0 < resp["usage"]["output_tokens_details"]["reasoning_tokens"] <= resp["usage"]["output_tokens"]
    evs = streamed(r1, input="What is the capital of France?", max_output_tokens=30)
    thought = "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta")
    assert thought == msg["reasoning_content"]
    assert evs[-1]["response"]["output"][0]["content"] == first["content"]


@pytest.mark.parametrize("body,param", [
    ({"input": ASK, "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": ASK, "conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ASK, "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": ASK, "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": ASK, "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": ASK, "model": "other"}, "model"),
])
def test_bad_requests_are_400s(qwen2, body: Dict[str, Any], param: str) -> None:
    r = call(qwen2, "/v1/responses", body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


# ---------------------------------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def server(tiny_qwen2_tools):
    from .helpers.server_process import running
    with running("--model", tiny_qwen2_tools) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.slow
def test_openai_client_create_and_stream(client) -> None:
    model = client.models.list().data[0].id
    r = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=16)
    ref = client.chat.completions.create(model=model, temperature=0, max_tokens=16,
                                         messages=[{"role": "user", "content": ASK}])
    assert r.output_text == ref.choices[0].message.content and r.usage.input_tokens == ref.usage.prompt_tokens
    r = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=200, text={
        "format": {"type": "json_schema", "name": "yn", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)

    with client.responses.stream(model=model, input=ASK, temperature=0, max_output_tokens=16) as stream:
        kinds, deltas = [], []
        for e in stream:
            kinds.append(e.type)
            if e.type == "response.output_text.delta":
                deltas.append(e.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta") \
        < kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert "".join(deltas) == final.output_text == ref.choices[0].message.content
    assert final.usage.output_tokens == ref.usage.completion_tokens and final.usage.total_tokens == \
        ref.usage.total_tokens
    raw = [e.type for e in client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=4,
                                                   stream=True)]
    assert raw[0] == "response.created" and raw[-1] == "response.completed"


@pytest.mark.slow
def test_openai_client_call_round_trip_and_400s(client, tiny_qwen2_tools) -> None:
    openai = pytest.importorskip("openai")
    from transformers import AutoTokenizer

    model = client.models.list().data[0].id
    r = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=300, tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"})
    (call_item,) = r.output
    assert call_item.type == "function_call" and call_item.name == "get_weather"
    jsonschema.validate(json.loads(call_item.arguments), WEATHER["parameters"])
    back = [{"role": "user", "content": ASK}, {"type": "function_call", "call_id": call_item.call_id,
                                               "name": call_item.name, "arguments": call_item.arguments},
            {"type": "function_call_output", "call_id": call_item.call_id, "output": "Sunny, 24 C"}]
    second = client.responses.create(model=model, input=back, tools=[WEATHER], temperature=0, max_output_tokens=8)
    # the second prompt is the template's rendering of the call and its result
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_tools)
    prompt = tok.apply_chat_template([{"role": "user", "content": ASK}, {"role": "assistant", "content": "",
                                      "tool_calls": [{"id": call_item.call_id, "type": "function", "function": {
                                          "name": "get_weather", "arguments": json.loads(call_item.arguments)}}]},
                                      {"role": "tool", "tool_call_id": call_item.call_id, "content": "Sunny, 24 C"}],
                                     tools=[CHAT_WEATHER], add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in prompt
    assert second.usage.input_tokens == len(tok(prompt, add_special_tokens=False).input_ids)

    for kw, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                      ({"input": [{"type": "image_generation_call", "id": "ig_1"}]}, "input"),
                      ({"input": []}, "input")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=model, **{"input": ASK, **kw})
        assert e.value.body["param"] == param
    assert client.responses.create(model=model, input=ASK, max_output_tokens=2).status == "incomplete"
