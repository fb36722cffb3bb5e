"""Thinking models through the chat endpoint: a tiny random-weight Qwen3 (helpers/tiny_qwen3_thinking.py) runs in
this process behind the real HTTP app (helpers/local_engine.py): its tokens are noise, so each expectation is
computed by hand from the tokens the response's logprobs list (their bytes, joined, are the output text), and what
the model must do is made certain by the request itself: the thinking budget forces `</think>`, a regex or schema
shapes the answer, logit_bias makes it open a thinking (`<think>`) or want to stop. One server process (slow)
checks the flag, `auto` and the startup errors. The pure parts: test_plan_reasoning.py.
"""
from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

import pytest

from minisrv.engine.request import RequestOutput, SamplingParams
from minisrv.server.messages import EngineInfo
from minisrv.server.app import create_app
from minisrv.server.state import ServerState

from .helpers.local_engine import LocalEngine, call, events
from .helpers.server_process import running
from .helpers.tiny_qwen3_thinking import CHAT_TEMPLATE, DEEPSEEK_TEMPLATE

jsonschema = pytest.importorskip("jsonschema")

THINK, END = 49152, 49153  # the ids helpers/tiny_qwen3_thinking.py's tokenizer gives <think> and </think>
EOS = 2  # <|im_end|>, the model's EOS
ASK = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}]


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def engine(tiny_qwen3_thinking):
    from minisrv.engine.engine import Engine
    return Engine(model=tiny_qwen3_thinking, attention_backend="torch", dtype="float32", log_level="warning",
                  max_total_tokens=4096)


def make_app(engine: Any, template: str = CHAT_TEMPLATE, parser: Optional[str] = "auto", client: Any = None):
    tok = copy.deepcopy(engine.parts.tokenizer)
    tok.chat_template = template
    return create_app(ServerState(client=client or LocalEngine(engine), tokenizer=tok, served_model_name="m",
                                  info=EngineInfo.from_engine(engine), reasoning_parser=parser))


@pytest.fixture(scope="module")
def qwen3(engine):
    return make_app(engine)


@pytest.fixture(scope="module")
def r1(engine):
    return make_app(engine, DEEPSEEK_TEMPLATE)


def post(app: Any, **body: Any):
    return call(app, "/v1/chat/completions", {"messages": ASK, "temperature": 0, **body})


def chat(app: Any, **body: Any) -> Dict[str, Any]:
    r = post(app, logprobs=True, **body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def tokens(choice: Dict[str, Any]) -> List[bytes]:
    return [bytes(t["bytes"]) for t in choice["logprobs"]["content"]]


def by_hand(toks: List[bytes], opened: bool) -> Tuple[Optional[str], Optional[str]]:
    """(reasoning, content) of an output, worked out from its tokens: the thinking runs from the start (the prompt
    opened it) or from a first token <think>, to </think>."""
    text = b"".join(toks).decode()
    if not opened:
        if not text.startswith("<think>"):
            return None, text
        text = text[len("<think>"):]
    reasoning, closed, answer = text.partition("</think>")
    return reasoning.strip() or None, (answer.lstrip() or None) if closed else None


def streamed(app: Any, **body: Any) -> Dict[str, Any]:
    """A streamed chat's deltas joined: reasoning, content, tool calls, finish reason; each delta checked."""
    r = post(app, stream=True, **body)
    assert r.status_code == 200, r.text
    evs = events(r)
    assert evs[-1] == "[DONE]"
    out: Dict[str, Any] = {"reasoning": "", "content": "", "calls": [], "finish": None}
    for ev in evs[:-1]:
        ch = ev["choices"][0]
        d = ch["delta"]
        assert d.get("reasoning") == d.get("reasoning_content")
        if d.get("reasoning_content"):
            assert not out["content"] and not d.get("content"), "reasoning after content"
            out["reasoning"] += d["reasoning_content"]
        out["content"] += d.get("content") or ""
        out["calls"] += d.get("tool_calls") or []
        out["finish"] = ch["finish_reason"] or out["finish"]
    return out


def test_budget_ends_the_thinking_then_a_regex_shapes_the_answer(r1) -> None:
    """DeepSeek-R1's way: the prompt opens the thinking; after 3 thinking tokens the 4th is the forced </think>."""
    body = dict(max_tokens=40, thinking_budget=3, regex="(Paris|Oslo)")
    ch = chat(r1, **body)
    toks = tokens(ch)
    assert toks[3] == b"</think>" and b"</think>" not in toks[:3]
    msg = ch["message"]
    assert (msg["reasoning_content"], msg["content"]) == by_hand(toks, opened=True)
    assert msg["reasoning"] == msg["reasoning_content"] and msg["content"] in ("Paris", "Oslo")
    assert ch["finish_reason"] == "stop"
    s = streamed(r1, **body)
    assert (s["reasoning"], s["content"], s["finish"]) == (msg["reasoning_content"], msg["content"], "stop")
    sglang = chat(r1, max_tokens=40, custom_params={"thinking_budget": 3}, regex="(Paris|Oslo)")
    assert sglang["message"] == msg  # SGLang's form of the budget


def test_cut_inside_the_thinking(r1) -> None:
    ch = chat(r1, max_tokens=6)
    toks = tokens(ch)
    assert b"</think>" not in toks and ch["finish_reason"] == "length"
    assert ch["message"]["content"] is None
    assert ch["message"]["reasoning_content"] == b"".join(toks).decode().strip()
    s = streamed(r1, max_tokens=6)
    assert (s["reasoning"], s["content"], s["finish"]) == (ch["message"]["reasoning_content"], "", "length")
    kept = chat(r1, max_tokens=6, separate_reasoning=False)["message"]  # SGLang's switch: all of it is content
    assert kept["content"] == b"".join(toks).decode() and "reasoning_content" not in kept
    assert streamed(r1, max_tokens=6, separate_reasoning=False)["content"] == kept["content"]


def test_qwen3_thinks_when_its_first_token_opens_it(qwen3) -> None:
    body = dict(max_tokens=20, logit_bias={str(THINK): 100}, thinking_budget=2, regex="(Paris|Oslo)")
    ch = chat(qwen3, **body)
    toks = tokens(ch)
    assert toks[:4] == [b"<think>"] * 3 + [b"</think>"]  # the opening <think>, 2 thinking tokens, the forced end
    msg = ch["message"]
    assert (msg["reasoning_content"], msg["content"]) == by_hand(toks, opened=False)
    assert msg["reasoning_content"] == "<think><think>" and msg["content"] in ("Paris", "Oslo")
    s = streamed(qwen3, **body)
    assert (s["reasoning"], s["content"]) == (msg["reasoning_content"], msg["content"])
    kept = chat(qwen3, separate_reasoning=False, **body)["message"]
    assert kept["content"] == b"".join(toks).decode()
    assert streamed(qwen3, separate_reasoning=False, **body)["content"] == kept["content"]


def test_qwen3_that_does_not_think_is_all_content(qwen3) -> None:
    ch = chat(qwen3, max_tokens=8)
    toks = tokens(ch)
    assert toks[0] != b"<think>"
    assert ch["message"]["content"] == b"".join(toks).decode() and "reasoning_content" not in ch["message"]
    assert streamed(qwen3, max_tokens=8) == {"reasoning": "", "content": ch["message"]["content"], "calls": [],
                                             "finish": "length"}


def test_enable_thinking_false_closes_the_thinking_in_the_prompt(qwen3, engine) -> None:
    """chat_template_kwargs reach the template, which writes an empty think block: the output is all answer, even
    a <think> the model is pushed to write, and a budget has nothing to end."""
    off = {"chat_template_kwargs": {"enable_thinking": False}, "logit_bias": {str(THINK): 100}, "max_tokens": 4,
           "thinking_budget": 1}
    r = post(qwen3, **off)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "<think>" * 4 and "reasoning_content" not in msg
    on = post(qwen3, max_tokens=4)
    block = engine.parts.tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False).input_ids
    assert r.json()["usage"]["prompt_tokens"] == on.json()["usage"]["prompt_tokens"] + len(block)
    assert streamed(qwen3, **off)["content"] == "<think>" * 4
    # /tokenize of the same chat counts the same prompt, with and without the switch; a reserved name is a 400
    for kwargs, chat in (({"enable_thinking": False}, r), (None, on)):
        t = call(qwen3, "/tokenize", {"messages": ASK, "chat_template_kwargs": kwargs})
        assert t.status_code == 200 and t.json()["count"] == chat.json()["usage"]["prompt_tokens"], t.text
    bad = call(qwen3, "/tokenize", {"messages": ASK, "chat_template_kwargs": {"tokenize": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.slow
@pytest.mark.parametrize("style", ["r1", "qwen3"])
def test_json_schema_after_the_thinking(style: str, request) -> None:
    """The schema holds for the answer only; while thinking the model may not stop (it wants to: EOS is biased)."""
    app = request.getfixturevalue(style)
    bias = {str(EOS): 100, **({str(THINK): 50} if style == "qwen3" else {})}
    body = dict(max_tokens=60, thinking_budget=3, logit_bias=bias,
                response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    ch = chat(app, **body)
    toks = tokens(ch)
    end = toks.index(b"</think>")
    assert end == (3 if style == "r1" else 4) and b"<|im_end|>" not in toks[:end]
    msg = ch["message"]
    assert (msg["reasoning_content"], msg["content"]) == by_hand(toks, opened=style == "r1")
    jsonschema.validate(json.loads(msg["content"]), CITY)
    assert ch["finish_reason"] == "stop"
    s = streamed(app, **body)
    assert (s["reasoning"], s["content"]) == (msg["reasoning_content"], msg["content"])


def test_forced_tool_call_after_the_thinking(r1) -> None:
    body = dict(max_tokens=80, thinking_budget=2, logit_bias={str(EOS): 100}, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_time"}})
    ch = chat(r1, **body)
    msg = ch["message"]
    assert tokens(ch)[2] == b"</think>" and msg["content"] is None and msg["reasoning_content"]
    (call_,) = msg["tool_calls"]
    jsonschema.validate(json.loads(call_["function"]["arguments"]), TOOLS[0]["function"]["parameters"])
    assert call_["function"]["name"] == "get_time" and ch["finish_reason"] == "tool_calls"
    s = streamed(r1, **body)
    assert s["reasoning"] == msg["reasoning_content"] and s["content"] == "" and s["finish"] == "tool_calls"
    assert "".join(c["function"]["arguments"] for c in s["calls"]) == call_["function"]["arguments"]


def test_budget_zero_ends_the_thinking_at_once(r1) -> None:
    ch = chat(r1, max_tokens=5, thinking_budget=0)
    toks = tokens(ch)
    assert toks[0] == b"</think>" and "reasoning_content" not in ch["message"]
    assert ch["message"]["content"] == b"".join(toks[1:]).decode().lstrip()


def test_without_a_parser_nothing_changes(engine) -> None:
    plain = make_app(engine, DEEPSEEK_TEMPLATE, parser=None)
    ch = chat(plain, max_tokens=6)
    assert ch["message"]["content"] == b"".join(tokens(ch)).decode() and "reasoning_content" not in ch["message"]
    r = post(plain, max_tokens=6, thinking_budget=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_budget"


@pytest.mark.parametrize("field,value,param", [
    ("thinking_budget", -1, "thinking_budget"), ("thinking_budget", "3", "thinking_budget"),
    ("thinking_budget", 1.5, "thinking_budget"), ("custom_params", {"thinking_budget": -1}, "custom_params"),
    ("separate_reasoning", "yes", "separate_reasoning"), ("chat_template_kwargs", "x", "chat_template_kwargs"),
    ("chat_template_kwargs", {"tools": []}, "chat_template_kwargs"),
    ("chat_template_kwargs", {"add_generation_prompt": False}, "chat_template_kwargs"),
])
def test_bad_fields_are_400s(qwen3, field: str, value: Any, param: str) -> None:
    r = post(qwen3, max_tokens=4, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


# ---------------------------------------------------------------------------------------------- scripted text
class Scripted:
    """Answers every request with the given text deltas (one token each), the last one ending it."""

    ready, dead = True, False

    def __init__(self, deltas: List[str]) -> None:
        self.deltas = deltas

    def submit(self, rid: str, prompt_ids: Any, params: SamplingParams, sink: asyncio.Queue, tag: Any) -> None:
        loop, offset = asyncio.get_running_loop(), 0
        for k, text in enumerate(self.deltas):
            last = k == len(self.deltas) - 1
            out = RequestOutput(rid, [5], text, [], [offset], last, "stop" if last else None,
                                num_output_tokens=k + 1)
            loop.call_later(0.001 * (k + 1), sink.put_nowait, (tag, out))
            offset += len(text)

    def abort(self, rid: str) -> None:
        pass


CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'


@pytest.mark.parametrize("deltas,reasoning,content,calls", [
    (["<think>I could write " + CALL[:12], CALL[12:] + " but no.</th", "ink>\n\nIt is ", "noon."],
     "I could write " + CALL + " but no.", "It is noon.", 0),  # a call inside the thinking is thought, not made
    (["<th", "ink>call it</think>\n", CALL], "call it", None, 1),
    (["It is noon.", CALL], None, "It is noon.", 1),  # no thinking: as before
])
def test_tools_read_only_the_answer(engine, deltas: List[str], reasoning: Optional[str], content: Optional[str],
                                    calls: int) -> None:
    app = make_app(engine, client=Scripted(deltas))
    r = post(app, tools=TOOLS)
    msg = r.json()["choices"][0]["message"]
    assert (msg.get("reasoning_content"), msg["content"], len(msg["tool_calls"] or [])) == (reasoning, content, calls)
    s = streamed(app, tools=TOOLS)
    assert (s["reasoning"] or None, s["content"] or None, len(s["calls"]) // 2) == (reasoning, content, calls)


# ---------------------------------------------------------------------------------------------- the server
@pytest.mark.slow  # starts server processes
def test_server_flag_auto_and_startup_errors(tiny_qwen3_thinking, tiny_model) -> None:
    """--reasoning-parser auto reads the Qwen3 template; an explicit parser the tokenizer cannot serve, or an
    unknown name, stops the startup with a message."""
    openai = pytest.importorskip("openai")
    with running("--model", tiny_qwen3_thinking, "--reasoning-parser", "auto") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        kw = dict(model=client.models.list().data[0].id, messages=ASK, temperature=0, max_tokens=12,
                  logit_bias={str(THINK): 100}, extra_body={"thinking_budget": 1, "regex": "(Paris|Oslo)"})
        msg = client.chat.completions.create(**kw).choices[0].message
        assert msg.content in ("Paris", "Oslo") and msg.model_extra["reasoning_content"] == "<think>"
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "<think>"
        assert "".join(d.content or "" for d in deltas) == msg.content
    base = [sys.executable, "-m", "minisrv.launch_server", "--port", "0", "--max-total-tokens", "4096"]
    bad = subprocess.run(base + ["--model", tiny_model("qwen3"), "--reasoning-parser", "qwen3"], capture_output=True,
                         text=True, timeout=240)
    assert bad.returncode == 1 and "no single, non-special token for <think>" in bad.stderr, bad.stderr
    unknown = subprocess.run(base + ["--reasoning-parser", "r1"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "--reasoning-parser: invalid choice: 'r1'" in unknown.stderr, unknown.stderr
