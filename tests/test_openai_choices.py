"""Choice constraints (vLLM's guided_choice and structured_outputs.choice, SGLang's choices) and the tool fields OpenAI
refuses without tools, on a tiny random Qwen2 behind the real HTTP app and a real engine in this process
(helpers/local_engine.py).

The model's tokens are noise, so a free answer is almost never one of the choices: that the answer always is one
(greedy and sampled, chat and completions, choices that share prefixes) shows the grammar decides it."""
from __future__ import annotations

import json

import pytest

from minisrv.server.messages import EngineInfo
from minisrv.server.app import create_app
from minisrv.server.plan.sampling import choice_grammar
from minisrv.server.state import ServerState

from .helpers.local_engine import LocalEngine, call, events

CHOICES = ["yes", "no", "not sure", "yes, but only on Mondays"]


@pytest.fixture(scope="module")
def app(tiny_qwen2_tools):
    from minisrv.engine.engine import Engine
    engine = Engine(model=tiny_qwen2_tools, attention_backend="torch", dtype="float32", log_level="warning",
                    max_total_tokens=4096)
    return create_app(ServerState(client=LocalEngine(engine), tokenizer=engine.parts.tokenizer, served_model_name="m",
                                  info=EngineInfo.from_engine(engine)))


@pytest.mark.slow
@pytest.mark.parametrize("field", ["guided_choice", "choices", "structured_outputs"])
def test_the_answer_is_one_of_the_choices(app, field):
    given = {"choice": CHOICES} if field == "structured_outputs" else CHOICES
    for seed in range(4):
        chat = call(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Is it Monday?"}],
                                                  field: given, "temperature": 1.0, "seed": seed,
                                                  "max_tokens": 30})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] in CHOICES
        assert chat.json()["choices"][0]["finish_reason"] == "stop"
    text = call(app, "/v1/completions", {"prompt": "Answer:", field: given, "temperature": 0, "max_tokens": 30})
    assert text.status_code == 200 and text.json()["choices"][0]["text"] in CHOICES


def test_choice_grammar_escapes_and_dedups():
    assert choice_grammar(None, None) is None
    assert choice_grammar(['say "hi"', "a\\b", "say \"hi\""], None) == 'root ::= "say \\"hi\\"" | "a\\\\b"'


@pytest.mark.parametrize("body,param", [
    ({"choices": []}, "choices"),
    ({"choices": ["a", ""]}, "choices"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"choices": ["a"], "guided_choice": ["b"]}, "choices"),
    ({"choices": ["a"], "ebnf": 'root ::= "x"'}, "ebnf"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar_spec": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "structured_outputs"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "none"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"best_of": 2}, "best_of"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_fields_are_400s_and_the_server_keeps_serving(app, body, param):
    r = call(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = call(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.slow
def test_vllm_structured_outputs_regex_and_json(app):
    """structured_outputs' regex and json constrain as the request's own regex and response_format do."""
    r = call(app, "/v1/completions", {"prompt": "Code:", "structured_outputs": {"regex": "[0-9]{4}"},
                                      "temperature": 1.0, "seed": 1, "max_tokens": 10})
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 4 \
        and r.json()["choices"][0]["text"].isdigit()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = call(app, "/v1/completions", {"prompt": "JSON:", "structured_outputs": {"json": schema}, "temperature": 0,
                                      "max_tokens": 40})
    assert r.status_code == 200, r.text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(r.json()["choices"][0]["text"])["n"], int)


@pytest.mark.slow
def test_legacy_functions_are_answered_in_function_call(app):
    """A request with the legacy `functions` gets its call in message.function_call (finish_reason
    "function_call"), plain and streamed, not in tool_calls; the same request with tools still gets tool_calls."""
    base = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 200, "temperature": 0}
    r = call(app, "/v1/chat/completions", {**base, "functions": [WEATHER], "function_call": {"name": "get_weather"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"] or choice["message"]["tool_calls"] is None
    call_ = choice["message"]["function_call"]
    assert call_["name"] == "get_weather"
    if choice["finish_reason"] != "length":  # (a random model's string may run past max_tokens)
        assert choice["finish_reason"] == "function_call" and isinstance(json.loads(call_["arguments"])["city"], str)
    s = call(app, "/v1/chat/completions", {**base, "functions": [WEATHER], "function_call": {"name": "get_weather"},
                                           "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events(s) if e != "[DONE]" and e["choices"]]
    streamed = [d["function_call"] for d in deltas if d.get("function_call")]
    assert streamed[0]["name"] == "get_weather" and "".join(d["arguments"] for d in streamed) == call_["arguments"]
    assert not any(d.get("tool_calls") for d in deltas)
    tools = call(app, "/v1/chat/completions",
                 {**base, "tools": [{"type": "function", "function": WEATHER}],
                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    message = tools.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == call_["arguments"] and "function_call" not in message


PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.slow
def test_tools_reach_a_model_whose_template_ignores_them(tiny_qwen2_tools):
    """A template that ignores `tools` gets them in a system prompt (the names, the parameters and the hermes
    call format the parser reads); a template that reads them gets them as before, and no such prompt."""
    import copy

    from minisrv.engine.engine import Engine
    from minisrv.server.plan.prompt import template_reads_tools
    engine = Engine(model=tiny_qwen2_tools, attention_backend="torch", dtype="float32", log_level="warning",
                    max_total_tokens=4096)
    plain = copy.deepcopy(engine.parts.tokenizer)
    plain.chat_template = PLAIN_TEMPLATE
    assert template_reads_tools(engine.parts.tokenizer) and not template_reads_tools(plain)
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
            "tools": [{"type": "function", "function": WEATHER}], "max_tokens": 2}
    for tok, own in ((plain, False), (engine.parts.tokenizer, True)):
        client = LocalEngine(engine)
        prompts = []
        submit = client.submit
        client.submit = lambda rid, ids, *a: (prompts.append(ids), submit(rid, ids, *a))
        app = create_app(ServerState(client=client, tokenizer=tok, served_model_name="m",
                                     info=EngineInfo.from_engine(engine)))
        assert call(app, "/v1/chat/completions", body).status_code == 200
        text = tok.decode(prompts[0])
        assert "get_weather" in text and "The weather in a city" in text
        assert ("<tool_call>" in text and "one block per call" in text) != own
        if not own:
            assert text.index("Be brief.") < text.index("get_weather") < text.index("Weather?")
