"""gpt-oss's harmony format on the chat APIs (server/plan/harmony.py), against openai-harmony itself: each API's
prompt ids equal the ids harmony renders for the same conversation built here by hand with its own classes, and a
scripted output (analysis, a tool call on commentary, final) comes back split into reasoning, tool calls and content
on chat, Responses and Messages, whole and streamed (helpers/harmony_server.py fakes the engine)."""
from __future__ import annotations

import json
from typing import Any, Dict, List

import openai_harmony as oh
import pytest

from minisrv.server.plan.harmony import HarmonyStream, load_encoding

from .helpers.harmony_server import harmony_app
from .helpers.local_engine import call, events

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": PARAMS}}]
ARGS = '{"city": "Paris"}'
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
CALL = ("<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
        + ARGS + "<|call|>")
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
REASONING, CONTENT = "The user wants the weather.", "It is sunny in Paris."


@pytest.fixture
def app_for(tmp_path):
    return lambda completion: harmony_app(str(tmp_path), completion)


# ------------------------------------------------------------------------------------------------ the prompts
def msg(role: Any, content: Any) -> Any:
    return oh.Message.from_role_and_content(role, content)


def rendered(messages: List[Any], effort: Any = None) -> List[int]:
    """harmony's own rendering of a system message (with `effort`) and then `messages`."""
    system = oh.SystemContent.new() if effort is None else oh.SystemContent.new().with_reasoning_effort(effort)
    return load_encoding().render_conversation_for_completion(
        oh.Conversation.from_messages([msg(oh.Role.SYSTEM, system)] + messages), oh.Role.ASSISTANT)


def tools_developer(instructions: str = "") -> Any:
    dev = oh.DeveloperContent.new()
    dev = dev.with_instructions(instructions) if instructions else dev
    return msg(oh.Role.DEVELOPER, dev.with_function_tools([oh.ToolDescription.new("get_weather", "Weather in a city",
                                                                                  PARAMS)]))


def earlier_turn() -> List[Any]:
    """A user's question, the assistant's reasoning and call, the call's result."""
    return [msg(oh.Role.USER, "Weather in Paris?"),
            msg(oh.Role.ASSISTANT, "Look it up.").with_channel("analysis"),
            msg(oh.Role.ASSISTANT, ARGS).with_channel("commentary").with_recipient("functions.get_weather")
            .with_content_type("<|constrain|>json"),
            oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.get_weather"), '{"sky": "clear"}')
            .with_channel("commentary").with_recipient("assistant")]


def test_chat_prompts_are_harmonys(app_for) -> None:
    app, client = app_for(FINAL[len("<|start|>assistant"):])
    ask = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in English."},
           {"role": "user", "content": "Weather in Paris?"}]
    assert call(app, "/v1/chat/completions", {"messages": ask, "tools": CHAT_TOOLS, "reasoning_effort": "high"}
                ).status_code == 200
    assert client.prompts[-1] == rendered([tools_developer("Be brief.\n\nAnswer in English."),
                                           msg(oh.Role.USER, "Weather in Paris?")], oh.ReasoningEffort.HIGH)
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
             {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "clear"}'}]
    assert call(app, "/v1/chat/completions", {"messages": turns, "tools": CHAT_TOOLS}).status_code == 200
    assert client.prompts[-1] == rendered([tools_developer()] + earlier_turn())
    # an answered turn: its analysis is dropped, as harmony drops it
    done = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
            {"role": "user", "content": "Bye"}]
    assert call(app, "/v1/chat/completions", {"messages": done, "reasoning_effort": "low"}).status_code == 200
    assert client.prompts[-1] == rendered([msg(oh.Role.USER, "Hi"),
                                           msg(oh.Role.ASSISTANT, "Greet.").with_channel("analysis"),
                                           msg(oh.Role.ASSISTANT, "Hello!").with_channel("final"),
                                           msg(oh.Role.USER, "Bye")], oh.ReasoningEffort.LOW)
    assert oh.ReasoningEffort.LOW.value.lower() in load_encoding().decode_utf8(client.prompts[-1]).lower()


def test_responses_and_messages_prompts_are_harmonys(app_for) -> None:
    app, client = app_for(FINAL[len("<|start|>assistant"):])
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": ARGS},
             {"type": "function_call_output", "call_id": "c1", "output": '{"sky": "clear"}'}]
    r = call(app, "/v1/responses", {"instructions": "Be brief.", "input": items, "reasoning": {"effort": "high"},
                                    "tools": [{"type": "function", "name": "get_weather",
                                               "description": "Weather in a city", "parameters": PARAMS}]})
    assert r.status_code == 200, r.text
    turn = [m for k, m in enumerate(earlier_turn()) if k != 1]  # Responses' reasoning items are not sent back
    assert client.prompts[-1] == rendered([tools_developer("Be brief.")] + turn, oh.ReasoningEffort.HIGH)
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
                                              {"type": "tool_use", "id": "c1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": '{"sky": "clear"}'}]}]
    r = call(app, "/v1/messages", {"max_tokens": 50, "system": "Be brief.", "messages": conv,
                                   "output_config": {"effort": "medium"},
                                   "tools": [{"name": "get_weather", "description": "Weather in a city",
                                              "input_schema": PARAMS}]})
    assert r.status_code == 200, r.text
    assert client.prompts[-1] == rendered([tools_developer("Be brief.")] + earlier_turn(), oh.ReasoningEffort.MEDIUM)
    counted = call(app, "/v1/messages/count_tokens", {"system": "Be brief.", "messages": conv,
                                                       "tools": [{"name": "get_weather",
                                                                  "description": "Weather in a city",
                                                                  "input_schema": PARAMS}]})
    assert counted.json() == {"input_tokens": len(rendered([tools_developer("Be brief.")] + earlier_turn()))}


# ------------------------------------------------------------------------------------------------ the outputs
def named_events(r: Any) -> List[Dict[str, Any]]:
    """The data of a stream of named events (`event: ...` then `data: ...`)."""
    return [json.loads(part.split("data: ", 1)[1]) for part in r.text.split("\n\n") if "data: " in part]


def chat_whole(app: Any) -> Dict[str, Any]:
    r = call(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather?"}],
                                           "tools": CHAT_TOOLS})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    m = ch["message"]
    assert m["reasoning"] == m["reasoning_content"]
    return {"reasoning": m["reasoning_content"], "content": m["content"], "finish": ch["finish_reason"],
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"] or []]}


def chat_streamed(app: Any) -> Dict[str, Any]:
    r = call(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather?"}],
                                           "tools": CHAT_TOOLS, "stream": True})
    out: Dict[str, Any] = {"reasoning": "", "content": "", "calls": [], "finish": None}
    for ev in events(r)[:-1]:
        ch = ev["choices"][0]
        d = ch["delta"]
        out["reasoning"] += d.get("reasoning_content") or ""
        out["content"] += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            if "id" in c:
                out["calls"].append((c["function"]["name"], ""))
            else:
                out["calls"][-1] = (out["calls"][-1][0], out["calls"][-1][1] + c["function"]["arguments"])
        out["finish"] = ch["finish_reason"] or out["finish"]
    return {k: v or None for k, v in out.items()}


def responses_output(app: Any, stream: bool) -> Dict[str, Any]:
    r = call(app, "/v1/responses", {"input": "Weather?", "stream": stream,
                                    "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}]})
    assert r.status_code == 200, r.text
    resp = named_events(r)[-1]["response"] if stream else r.json()
    if stream:
        deltas = [e for e in named_events(r) if e["type"] == "response.reasoning_text.delta"]
        assert "".join(e["delta"] for e in deltas) == REASONING
    out: Dict[str, Any] = {"reasoning": None, "content": None, "calls": []}
    for item in resp["output"]:
        if item["type"] == "reasoning":
            out["reasoning"] = item["content"][0]["text"]
        elif item["type"] == "message":
            out["content"] = item["content"][0]["text"] or None
        else:
            out["calls"].append((item["name"], item["arguments"]))
    return out


def messages_output(app: Any, stream: bool) -> Dict[str, Any]:
    r = call(app, "/v1/messages", {"max_tokens": 100, "stream": stream,
                                   "messages": [{"role": "user", "content": "Weather?"}],
                                   "tools": [{"name": "get_weather", "input_schema": PARAMS}]})
    assert r.status_code == 200, r.text
    if stream:
        blocks: List[Dict[str, Any]] = []
        for e in named_events(r):
            if e["type"] == "content_block_start":
                blocks.append(dict(e["content_block"]))
            elif e["type"] == "content_block_delta":
                d, b = e["delta"], blocks[e["index"]]
                key = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "json"}[d["type"]]
                b[key] = b.get(key, "") + d[{"json": "partial_json"}.get(key, key)]
        for b in blocks:
            if b["type"] == "tool_use":
                b["input"] = json.loads(b.pop("json"))
    else:
        blocks = r.json()["content"]
    out: Dict[str, Any] = {"reasoning": None, "content": None, "calls": []}
    for b in blocks:
        if b["type"] == "thinking":
            out["reasoning"] = b["thinking"]
        elif b["type"] == "text":
            out["content"] = b["text"] or None
        else:
            out["calls"].append((b["name"], json.dumps(b["input"])))
    return out


@pytest.mark.parametrize("completion,content,finish", [
    (ANALYSIS + CALL, None, "tool_calls"),  # the model stops at <|call|>
    (ANALYSIS + CALL + FINAL, CONTENT, "tool_calls"),  # the three channels in one output
])
def test_channels_split_on_every_api(app_for, completion: str, content: Any, finish: str) -> None:
    app, _ = app_for(completion)
    want = {"reasoning": REASONING, "content": content, "calls": [("get_weather", ARGS)]}
    assert chat_whole(app) == {**want, "finish": finish}
    assert chat_streamed(app) == {**want, "finish": finish}
    for stream in (False, True):
        assert responses_output(app, stream) == want
        assert messages_output(app, stream) == want


def test_a_plain_answer_and_the_stop_tokens(app_for) -> None:
    app, client = app_for(ANALYSIS + FINAL)
    got = chat_whole(app)
    assert got == {"reasoning": REASONING, "content": CONTENT, "calls": [], "finish": "stop"}
    assert chat_streamed(app) == {**got, "calls": None}
    # <|call|> and <|return|> end the output
    assert set(client.params[-1].stop_token_ids) == set(load_encoding().encode("<|call|><|return|>",
                                                                               allowed_special="all"))
    r = call(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                           "separate_reasoning": False})
    assert r.json()["choices"][0]["message"]["content"] == REASONING + CONTENT


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"thinking_budget": 10}, "thinking_budget"),
    ("/v1/chat/completions", {"tools": CHAT_TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"reasoning": {"effort": "max"}}, "reasoning"),
])
def test_what_harmony_cannot_serve_is_a_400(app_for, path: str, body: Dict[str, Any], param: str) -> None:
    app, _ = app_for(ANALYSIS + FINAL)
    base = {"input": "Hi"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = call(app, path, {**base, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_cut_off_calls_are_dropped_and_broken_output_is_content() -> None:
    enc = load_encoding()
    # characters cut across tokens come whole
    text = "Il fait beau à Paris 🌞🌧️ 東京"
    ids = enc.encode(f"<|channel|>final<|message|>{text}<|return|>", allowed_special="all")
    stream = HarmonyStream(enc, [])
    assert "".join(stream.feed([t], k == len(ids) - 1)[1] for k, t in enumerate(ids)) == text
    ids = enc.encode(ANALYSIS + CALL[:-len('"}<|call|>')], allowed_special="all")
    assert HarmonyStream(enc, ["get_weather"]).feed(ids, True) == (REASONING, "", [])
    _, content, calls = HarmonyStream(enc, ["get_weather"]).feed(enc.encode("Just text."), True)
    assert (content, calls) == ("Just text.", [])
    broken = enc.encode("<|channel|>final<|message|>Hi.<|end|> Then no header.", allowed_special="all")
    assert HarmonyStream(enc, []).feed(broken, True) == ("", "Hi. Then no header.", [])
    # a call to a function the request did not offer is content
    _, content, calls = HarmonyStream(enc, []).feed(enc.encode(ANALYSIS + CALL, allowed_special="all"), True)
    assert (content, calls) == (ARGS, [])
