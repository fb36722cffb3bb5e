"""Tool calling through a real server with the official openai client, on a tiny random-weight Qwen2 whose chat
template is Qwen2.5's tool format (helpers/tiny_qwen2.py): the tools reach the template and so do earlier calls and
their results; tool_choice "required" and a named function give calls whose arguments validate against the
function's schema (jsonschema is the judge), plain and streamed alike; "auto" reads a Hermes call out of the text;
a call cut off by max_tokens says "length"; bad tools and tool_choices are 400s in OpenAI's error shape and the
server keeps serving.

The model's weights are random, so its text is noise: the tools' schemas are bounded (enums, integer ranges) so
that every path through a forced call's grammar is short, whichever tokens the model prefers.
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from minisrv.server.plan.tools import parser_for  # noqa: E402

from .helpers.server_process import Server, running  # noqa: E402
from .helpers.tiny_qwen2 import CHAT_TEMPLATE  # noqa: E402

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow  # starts server processes

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
MAX_TOKENS = 600  # a forced call of these schemas is far shorter, even with the most whitespace its grammar allows


@pytest.fixture(scope="module")
def srv(tiny_qwen2_tools) -> Iterator[Server]:
    with running("--model", tiny_qwen2_tools) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference_tokenizer(tiny_qwen2_tools):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_qwen2_tools)


def _valid_call(name: str, arguments: str) -> Dict[str, Any]:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _stream(client, **kw) -> Tuple[List[Dict[str, Any]], Optional[str], str]:
    """A streamed chat: (its tool calls by index, as {"id", "name", "arguments"}; the finish reason; content)."""
    calls: Dict[int, Dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.function and tc.function.name:
                assert slot["name"] is None and not slot["arguments"], "a call's id and name come first, once"
                slot.update(id=tc.id, name=tc.function.name)
            slot["arguments"] += (tc.function.arguments if tc.function else None) or ""
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def test_the_template_is_detected_as_hermes():
    assert parser_for(CHAT_TEMPLATE, "auto") == "hermes"


def test_the_template_sees_the_tools_and_earlier_calls(client, model, reference_tokenizer):
    """The prompt the server builds is the one transformers builds from the same template (counted in tokens):
    tools in the system turn, an earlier call (its arguments a JSON string, as clients send them; an object, as
    templates take them) and its results as tool messages."""
    def reference(messages, tools=None) -> int:
        return len(reference_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                           tokenize=True, return_dict=True)["input_ids"])

    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == reference(ASK, TOOLS)
    assert reference(ASK, TOOLS) > reference(ASK) + 100  # the tools really are in it
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1,
                                       temperature=0)
    assert r.usage.prompt_tokens == reference(ASK)  # tool_choice none: the template sees no tools
    args = {"city": "Paris", "days": 3}
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    as_template_takes_them = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
        *history[2:]]
    text = reference_tokenizer.apply_chat_template(as_template_takes_them, tools=TOOLS, add_generation_prompt=True,
                                                   tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert text.count("<tool_response>") == 2
    assert r.usage.prompt_tokens == reference(as_template_takes_them, TOOLS)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_plain_and_streamed(client, model, choice):
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=MAX_TOKENS, temperature=0)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls and c.message.content is None, c.message
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        _valid_call(call.function.name, call.function.arguments)
    if choice != "required":
        assert [call.function.name for call in c.message.tool_calls] == [choice["function"]["name"]]
    # streamed (greedy: the same output): each call's id and name first, then its arguments
    calls, finish, content = _stream(client, **kw)
    assert finish == "tool_calls" and not content
    assert [(s["name"], s["arguments"]) for s in calls] == \
        [(call.function.name, call.function.arguments) for call in c.message.tool_calls]
    assert all(s["id"].startswith("call_") for s in calls) and len({s["id"] for s in calls}) == len(calls)


def test_a_call_cut_off_by_max_tokens_says_length(client, model):
    kw = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=2, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    assert _stream(client, **kw)[1] == "length"


def test_auto_parses_a_hermes_call(client, model):
    """The model is made to write a Hermes call (a regex of exactly that text); tool_choice auto reads it back."""
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=100, temperature=0,
              extra_body={"regex": re.escape(forced)})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [call.function.name for call in c.message.tool_calls] == ["get_weather"]
    assert _valid_call("get_weather", c.message.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 3}
    calls, finish, content = _stream(client, **kw)
    assert finish == "tool_calls" and not content
    assert [(s["name"], json.loads(s["arguments"])) for s in calls] == [("get_weather", {"city": "Oslo", "days": 3})]
    # text before the call stays content; tool_choice none leaves the same text alone
    forced_after_text = "Let me look.\n" + forced
    kw["extra_body"] = {"regex": re.escape(forced_after_text)}
    c = client.chat.completions.create(**kw).choices[0]
    assert c.message.content == "Let me look." and c.message.tool_calls[0].function.name == "get_weather"
    c = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert c.finish_reason == "stop" and c.message.tool_calls is None and c.message.content == forced_after_text


BROKEN = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"x": {"type": "strng"}}}}}


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
    ({"tools": [WEATHER, BROKEN]}, "tools"),
    ({"tools": [WEATHER, BROKEN], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400s_and_the_server_keeps_serving(srv, client, model, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **body)
    err = e.value.response.json()
    assert e.value.status_code == 400 and set(err) == {"error"}, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"], err
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    _valid_call("get_time", r.choices[0].message.tool_calls[0].function.arguments)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
