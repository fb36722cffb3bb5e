"""Tool calling, the pure parts: validating tools / tool_choice (and the legacy functions), the grammars that
enforce required and named choices, and reading Hermes and Llama-3 tool-call text back into OpenAI tool_calls."""
from __future__ import annotations

import json

import pytest

from minisrv.engine.request import RequestError
from minisrv.server.plan.tools import content_prefix_len, parse_tool_calls, parser_for, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_plans():
    assert plan_tools(None, None).mode == "off"
    assert plan_tools([WEATHER], "none").mode == "off" and plan_tools([WEATHER], "none").template_tools is None
    auto = plan_tools([WEATHER, TIME], None)
    assert auto.mode == "auto" and auto.names == ["get_weather", "get_time"] and auto.json_schema is None
    req = plan_tools([WEATHER, TIME], "required")
    schema = json.loads(req.json_schema)
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and json.loads(named.json_schema) == WEATHER["function"]["parameters"]
    legacy = plan_tools(None, None, functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    assert legacy.mode == "named" and legacy.named == "get_weather"


@pytest.mark.parametrize("tools,choice,param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], None, "tools"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}],
     "required", "tools"),
    ([{"type": "retrieval"}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    (None, "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
])
def test_bad_tools_are_request_errors(tools, choice, param):
    with pytest.raises(RequestError) as e:
        plan_tools(tools, choice)
    assert e.value.param == param


def test_hermes_parse():
    plan = plan_tools([WEATHER, TIME], "auto", parser="hermes")
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, plan)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert calls[0].to_openai(0)["function"]["arguments"] == '{"city": "Paris"}' and calls[0].id.startswith("call_")
    assert parse_tool_calls("no call here", plan) == ("no call here", [])
    assert parse_tool_calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', plan)[1] == []


def test_llama3_parse():
    plan = plan_tools([WEATHER], "auto", parser="llama3_json")
    content, calls = parse_tool_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', plan)
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert parse_tool_calls("The weather is fine.", plan) == ("The weather is fine.", [])


def test_required_and_named_outputs():
    req = plan_tools([WEATHER, TIME], "required")
    content, calls = parse_tool_calls('[{"name": "get_time", "parameters": {}}]', req)
    assert content is None and calls[0].name == "get_time"
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    content, calls = parse_tool_calls(' {"city": "Rome"} ', named)
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}


def test_streaming_holds_back_a_possible_call():
    plan = plan_tools([WEATHER], "auto", parser="hermes")
    assert content_prefix_len("Hello there", plan) == len("Hello there")
    assert content_prefix_len("Hello <tool", plan) == len("Hello ")
    assert content_prefix_len("Hi <tool_call>{", plan) == len("Hi ")
    llama = plan_tools([WEATHER], "auto", parser="llama3_json")
    assert content_prefix_len('{"name"', llama) == 0 and content_prefix_len("Sure, ", llama) == len("Sure, ")


def test_parser_detection():
    assert parser_for("{% if tools %}<tool_call>{% endif %}", "auto") == "hermes"
    assert parser_for("<|python_tag|> ipython", "auto") == "llama3_json"
    assert parser_for(None, "llama3_json") == "llama3_json"
