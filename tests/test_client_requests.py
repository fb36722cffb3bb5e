"""What two agent CLIs send by default, answered: the recorded first requests of Claude Code (/v1/messages) and
Codex CLI (/v1/responses) in tests/fixtures/clients/ (its README says how they were recorded), posted as they were
sent (but for the model's name) to the server over a scripted engine.

The reference is the recorded request itself: the prompt the engine was given is read back as text, and each part
of the request is looked for where the chat template puts it: a system message sent inside `messages` as a system
turn after the user turn before it, every client tool (a namespace's included) in the tool prompt the default
model's template needs, the hosted tools nowhere. The default prompts are longer than the default model's 8,192
tokens (docs/clients.md), so the scripted engine claims a longer context, and one test shows the 8k answer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from minisrv.engine.request import RequestOutput, SamplingParams
from minisrv.server.app import create_app
from minisrv.server.messages import EngineInfo
from minisrv.server.state import ServerState

from .helpers.local_engine import call
from .test_anthropic_api import anthropic_error, assembled, sse
from .test_generation_path import VOCAB, ScriptedEngine, hello_world, output, tokenizer, words  # noqa: F401
from .test_responses_api import sse as responses_sse

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
CLAUDE_CODE = "claude-code-2.1.197-messages.json"
CODEX = "codex-0.171.0-responses.json"
LONG_CONTEXT = 65536


def recorded(name: str) -> Dict[str, Any]:
    body = json.loads((FIXTURES / name).read_text())
    body["model"] = "m"  # the served name (the clients were told the one they were recorded against)
    return body


def make_app(tokenizer: Any, engine: ScriptedEngine, context: int = LONG_CONTEXT) -> Any:
    info = EngineInfo("m.gguf", "torch", "cpu", context, context, VOCAB)
    return create_app(ServerState(client=engine, tokenizer=tokenizer, info=info, served_model_name="m"))


def prompt_text(tokenizer: Any, engine: ScriptedEngine) -> str:
    assert len(engine.submitted) == 1
    return tokenizer.decode(engine.submitted[0].prompt_ids)


def turn_of(prompt: str, text: str) -> str:
    """The role of the chat-template turn (ChatML: <|im_start|>role) that holds `text`."""
    at = prompt.index(text)
    start = prompt.rindex("<|im_start|>", 0, at) + len("<|im_start|>")
    assert "<|im_end|>" not in prompt[start:at], f"{text[:40]!r} is outside a turn"
    return prompt[start:prompt.index("\n", start)]


def offered(prompt: str, name: str) -> bool:
    """Whether a function of this name is in the tool prompt (the default model's template ignores `tools`, so
    the server lists each function as JSON in the system turn)."""
    return f'{{"name": "{name}"' in prompt


def one_call(name: str, arguments: Dict[str, Any], words: List[int]):
    """A script that answers with one hermes-format tool call, then EOS."""
    hello, _, eos = words
    text = "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"

    def script(rid: str, prompt: List[int], params: SamplingParams) -> List[RequestOutput]:
        return [output(rid, hello, text, 0, 1), output(rid, eos, "", len(text), 2, "stop")]
    return script


# ---------------------------------------------------------------------------------------------- Claude Code
def test_claude_code_default_request(tokenizer, words) -> None:
    body = recorded(CLAUDE_CODE)
    engine = ScriptedEngine(hello_world(words))
    r = call(make_app(tokenizer, engine), "/v1/messages?beta=true", body)
    assert r.status_code == 200, r.text
    message = assembled(sse(r))
    assert message["content"] == [{"type": "text", "text": " Hello world"}]
    assert message["stop_reason"] == "end_turn" and message["model"] == "m"
    assert engine.submitted[0].params.max_tokens == body["max_tokens"]

    prompt = prompt_text(tokenizer, engine)
    # the system blocks, then the user turn, then the system message the client put after it, in place
    user_text = body["messages"][0]["content"][1]["text"]
    later_system = body["messages"][1]
    assert later_system["role"] == "system" and user_text == "say hello"
    agents = later_system["content"][:40]
    assert turn_of(prompt, body["system"][1]["text"]) == "system"
    assert turn_of(prompt, user_text) == "user" and turn_of(prompt, agents) == "system"
    assert prompt.index(body["system"][1]["text"]) < prompt.index(user_text) < prompt.index(agents)
    # every tool the client sent is offered as a function
    assert len(body["tools"]) == 25
    for tool in body["tools"]:
        assert offered(prompt, tool["name"]), tool["name"]


def test_claude_code_count_tokens_is_the_generation_prompt(tokenizer, words) -> None:
    body = recorded(CLAUDE_CODE)
    engine = ScriptedEngine(hello_world(words))
    app = make_app(tokenizer, engine)
    assert call(app, "/v1/messages", body).status_code == 200
    r = call(app, "/v1/messages/count_tokens?beta=true", body)
    assert r.status_code == 200, r.text
    with_tools = r.json()["input_tokens"]
    assert with_tools == len(engine.submitted[0].prompt_ids)
    without = call(app, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "tools"})
    assert with_tools > without.json()["input_tokens"] + 10000  # 25 tools with long descriptions


def test_claude_code_default_request_is_longer_than_the_default_context(tokenizer, words) -> None:
    """On the default model's 8,192 tokens the prompt alone does not fit, whatever the output cap: a 400 in
    Anthropic's shape that says how long it is, and nothing reaches the engine."""
    body = dict(recorded(CLAUDE_CODE), max_tokens=1024)
    engine = ScriptedEngine(hello_world(words))
    message = anthropic_error(call(make_app(tokenizer, engine, context=8192), "/v1/messages", body), 400,
                              "invalid_request_error")
    assert "maximum context length is 8192 tokens" in message
    assert engine.submitted == []


# ---------------------------------------------------------------------------------------------- Codex CLI
def test_codex_default_request(tokenizer, words) -> None:
    body = recorded(CODEX)
    engine = ScriptedEngine(hello_world(words))
    r = call(make_app(tokenizer, engine), "/v1/responses", body)
    assert r.status_code == 200, r.text
    evs = responses_sse(r.text)
    assert evs[0]["type"] == "response.created" and evs[-1]["type"] == "response.completed"
    done = evs[-1]["response"]
    assert done["status"] == "completed" and done["model"] == "m"
    assert [item["type"] for item in done["output"]] == ["message"]
    assert done["output"][0]["content"][0]["text"] == " Hello world"

    prompt = prompt_text(tokenizer, engine)
    developer, user = body["input"][0]["content"][0]["text"], body["input"][3]["content"][0]["text"]
    assert body["input"][0]["role"] == "developer" and user == "say hello"
    assert turn_of(prompt, developer[:60]) == "system" and turn_of(prompt, user) == "user"
    kinds = [t["type"] for t in body["tools"]]
    assert kinds.count("namespace") == 1 and kinds.count("web_search") == 1
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    functions = [t for t in body["tools"] if t["type"] == "function"] + namespace["tools"]
    assert len(functions) == 12
    for fn in functions:
        assert offered(prompt, fn["name"]), fn["name"]
    assert not offered(prompt, "web_search") and not offered(prompt, namespace["name"])


@pytest.mark.parametrize("name,namespace", [("wait_agent", "multi_agent_v1"), ("exec_command", None)])
def test_codex_call_carries_its_namespace_and_comes_back(tokenizer, words, name, namespace) -> None:
    """Codex runs a namespace's function only when the call names the namespace (`"namespace": ...` beside the
    bare name; without it Codex answers "unsupported call"), and sends the call back so in the next request."""
    body = recorded(CODEX)
    args = {"targets": ["a1"]} if namespace else {"cmd": "ls"}
    engine = ScriptedEngine(one_call(name, args, words))
    app = make_app(tokenizer, engine)
    whole = call(app, "/v1/responses", dict(body, stream=False))
    assert whole.status_code == 200, whole.text
    streamed = call(app, "/v1/responses", body)
    assert streamed.status_code == 200, streamed.text
    evs = responses_sse(streamed.text)
    added = [e["item"] for e in evs if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    for item in (whole.json()["output"][-1], added[-1], done[-1], evs[-1]["response"]["output"][-1]):
        assert item["type"] == "function_call" and item["name"] == name and item.get("namespace") == namespace
    item = done[-1]
    assert json.loads(item["arguments"]) == args

    sent_back = {k: item[k] for k in ("type", "name", "namespace", "arguments", "call_id") if k in item}
    follow_up = dict(body, input=body["input"] + [sent_back, {"type": "function_call_output",
                                                              "call_id": item["call_id"], "output": "ok"}])
    engine.script = hello_world(words)
    r = call(app, "/v1/responses", follow_up)
    assert r.status_code == 200, r.text
    assert responses_sse(r.text)[-1]["response"]["output"][0]["content"][0]["text"] == " Hello world"
