"""The request plan with what agent clients send by default (Claude Code, Codex CLI) and the tool-call rules they
rely on: parallel_tool_calls false gives one call; a call list cut by max_tokens keeps its complete calls; the
tools reach the prompt on every API (count_tokens counts them); a system message may stand anywhere; a Responses
namespace's function tools are offered and hosted tools are left out; Anthropic's disable_parallel_tool_use is
honoured.

Forced calls run on a tiny random-weight Qwen2 whose template is Qwen2.5's tool format (its grammar makes the
call whatever the weights prefer); counting runs on the default model's tokenizer, whose template ignores tools.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from minisrv.engine.request import RequestError
from minisrv.server.anthropic.routes import CountTokensRequest
from minisrv.server.anthropic.routes import chat_inputs as anthropic_inputs
from minisrv.server.app import create_app
from minisrv.server.generation import Choice
from minisrv.server.messages import EngineInfo
from minisrv.server.openai.render import ChatRenderer
from minisrv.server.openai.protocol import UsageInfo
from minisrv.server.plan.answer import read_answer
from minisrv.server.plan.prompt import PromptMaker
from minisrv.server.plan.tools import parse_tool_calls, plan_tools
from minisrv.server.responses.routes import ResponsesRequest
from minisrv.server.responses.routes import chat_inputs as responses_inputs
from minisrv.server.state import ServerState

from .helpers.local_engine import LocalEngine, call, events

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]


def anthropic_tool(tool: Dict[str, Any]) -> Dict[str, Any]:
    fn = tool["function"]
    return {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}


@pytest.fixture(scope="module")
def app(tiny_qwen2_tools):
    from minisrv.engine.engine import Engine
    engine = Engine(model=tiny_qwen2_tools, attention_backend="torch", dtype="float32", log_level="warning",
                    max_total_tokens=4096)
    return create_app(ServerState(client=LocalEngine(engine), tokenizer=engine.parts.tokenizer, served_model_name="m",
                                  info=EngineInfo.from_engine(engine)))


class _IdleEngine:
    """Stands in for the engine process where nothing is generated (counting prompts)."""

    ready, dead = True, False

    async def fresh_stats(self, timeout: float = 0.5) -> Dict[str, Any]:
        return {}


@pytest.fixture(scope="module")
def default_tokenizer():
    from minisrv.checkpoints.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="module")
def counting_app(default_tokenizer):
    info = EngineInfo("m.gguf", "torch", "cpu", 8192, 8192, len(default_tokenizer))
    return create_app(ServerState(client=_IdleEngine(), tokenizer=default_tokenizer, info=info, served_model_name="m"))


# ---------------------------------------------------------------------------------------------- one call, or many
@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_required_without_parallel_calls_is_exactly_one_call(app, stream):
    for seed in range(2):
        body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False,
                "max_tokens": 200, "seed": seed, "temperature": 1.0, "stream": stream}
        r = call(app, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        if stream:
            opened = [c for chunk in events(r) if isinstance(chunk, dict) for ch in chunk["choices"]
                      for c in ch["delta"].get("tool_calls") or [] if c.get("id")]
            assert len(opened) == 1
        else:
            calls = r.json()["choices"][0]["message"]["tool_calls"]
            assert len(calls) == 1 and calls[0]["function"]["name"] in ("get_weather", "get_time")
            json.loads(calls[0]["function"]["arguments"])


def test_the_plan_allows_one_call_without_parallel_calls():
    serial = plan_tools([WEATHER, TIME], "required", parallel=False)
    assert json.loads(serial.json_schema)["maxItems"] == 1
    assert "maxItems" not in json.loads(plan_tools([WEATHER, TIME], "required").json_schema)
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
           '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    assert [c.name for c in read_answer(two, plan_tools([WEATHER, TIME], "auto"), None).calls] == ["get_weather",
                                                                                                   "get_time"]
    assert [c.name for c in read_answer(two, plan_tools([WEATHER, TIME], "auto", parallel=False), None).calls] == \
        ["get_weather"]
    with pytest.raises(RequestError):
        plan_tools(None, None, parallel=False)


def test_a_call_list_cut_by_max_tokens_keeps_its_complete_calls():
    plan = plan_tools([WEATHER, TIME], "required")
    cut = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {"zo'
    content, calls = parse_tool_calls(cut, plan)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                                        {"city": "Oslo"})]
    renderer = ChatRenderer("c", "m", tools=plan)
    choice = renderer.response([Choice(0, text=cut, finish_reason="length")], UsageInfo()).choices[0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert read_answer('[{"name": "get_w', plan, None).calls == []  # nothing complete: the text stays content


# ---------------------------------------------------------------------------------------------- tools reach the prompt
def test_count_tokens_counts_the_tools_on_the_default_model(counting_app):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = call(counting_app, "/v1/messages/count_tokens", {"messages": msgs})
    tools = call(counting_app, "/v1/messages/count_tokens", {"messages": msgs, "tools": [anthropic_tool(WEATHER)]})
    assert plain.status_code == tools.status_code == 200, (plain.text, tools.text)
    assert tools.json()["input_tokens"] > plain.json()["input_tokens"]
    chat = call(counting_app, "/tokenize", {"messages": msgs})
    assert chat.json()["count"] == plain.json()["input_tokens"]  # the same prompt by both APIs
    chat = call(counting_app, "/tokenize", {"messages": msgs, "tools": [WEATHER]})
    assert chat.json()["count"] == tools.json()["input_tokens"]


# ---------------------------------------------------------------------------------------------- system messages
def test_a_system_message_inside_anthropic_messages_is_templated_in_place(counting_app, default_tokenizer):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Reminder: be brief."}, {"role": "user", "content": "Weather?"}]
    r = call(counting_app, "/v1/messages/count_tokens", {"messages": msgs})
    assert r.status_code == 200, r.text
    want = default_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r.json()["input_tokens"] == len(default_tokenizer(want, add_special_tokens=False).input_ids)


class _FirstSystemOnly:
    """A tokenizer whose chat template refuses a system message that is not the first, as some templates do."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt=True, continue_final_message=False,
                            tokenize=False, **kwargs) -> str:
        if any(m["role"] == "system" for m in messages[1:]):
            raise ValueError("System role only at the beginning")
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def test_where_the_template_refuses_a_later_system_message_it_joins_the_first():
    maker = PromptMaker(_FirstSystemOnly())
    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"}]
    assert maker.template(msgs) == "system:Be kind.\n\nBe brief.|user:Hi|user:Go"
    assert maker.template(msgs[1:]) == "system:Be brief.|user:Hi|user:Go"
    assert maker.template(msgs[:2]) == "system:Be kind.|user:Hi"


# ---------------------------------------------------------------------------------------------- what clients send
def test_a_responses_namespace_is_its_functions_and_hosted_tools_are_left_out(caplog):
    fn = {"type": "function", "name": "shell", "description": "Run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
    req = ResponsesRequest.model_validate({"input": "hi", "tools": [
        {"type": "namespace", "name": "functions", "description": "", "tools": [fn]},
        {"type": "web_search", "external_web_access": False}, {"type": "file_search"}, {"type": "computer_use"}]})
    with caplog.at_level("INFO", logger="minisrv.server"):
        inputs = responses_inputs(req)
    assert inputs.tools == [{"type": "function", "function": {k: fn[k] for k in ("name", "description",
                                                                                  "parameters")}}]
    assert "web_search" in caplog.text and "file_search" in caplog.text
    only_hosted = responses_inputs(ResponsesRequest.model_validate(
        {"input": "hi", "tools": [{"type": "web_search_preview"}], "tool_choice": "auto"}))
    assert only_hosted.tools is None and only_hosted.tool_choice is None


@pytest.mark.slow
def test_codex_default_tools_are_served(app):
    fn = {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}
    tools = [{"type": "namespace", "name": "functions", "tools": [fn]}, {"type": "web_search"}]
    r = call(app, "/v1/responses", {"input": "hi", "max_output_tokens": 4, "tools": tools})
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_anthropic_server_tools_are_left_out_and_parallel_use_can_be_disabled(app):
    body = {"messages": ASK, "tools": [anthropic_tool(WEATHER), anthropic_tool(TIME),
                                       {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    inputs = anthropic_inputs(CountTokensRequest.model_validate(body), False)
    assert [t["function"]["name"] for t in inputs.tools] == ["get_weather", "get_time"]
    assert inputs.tool_choice == "required" and inputs.parallel_tool_calls is False
    for seed in range(2):
        r = call(app, "/v1/messages", {**body, "max_tokens": 200, "temperature": 1.0, "metadata": {"seed": seed}})
        assert r.status_code == 200, r.text
        uses: List[Dict[str, Any]] = [b for b in r.json()["content"] if b["type"] == "tool_use"]
        assert len(uses) == 1 and r.json()["stop_reason"] == "tool_use"
