"""The streaming path's shortcuts against the general path they replace: an OpenAI stream chunk made by
OpenAIStream.event (the envelope's JSON made once, each chunk's choice serialized alone) is byte for byte what
sse(frame(...)) writes through the pydantic envelope, and a RequestOutput crosses the engine pipe (pickled as its
fields) equal to what was sent."""
from __future__ import annotations

import pickle
from typing import Any, Dict, List

import pytest

from minisrv.engine.request import RequestOutput, TokenLogprob
from minisrv.server.openai.protocol import chat_message
from minisrv.server.openai.render import ChatRenderer, CompletionRenderer, _choice
from minisrv.server.streaming import sse

TEXTS = ["", " Hello", "naïve café", "日本語のテキスト", "emoji 🎉👍🏽", 'quote " and \\ backslash',
         "tab\tnew\nline\r",
         "\x00\x01\x1f\x7f control", "</script><!-- &amp; -->", "\u2028\u2029 separators", "\ud7ff\ue000\uffff",
         '{"choices":[]} inside', ',"choices":[] inside']


def choices() -> List[Dict[str, Any]]:
    """Chunks' choices of every shape the renderers make: text, deltas with content, reasoning, tool calls, a role,
    logprobs (with awkward floats) and finish reasons."""
    out: List[Dict[str, Any]] = []
    for i, text in enumerate(TEXTS):
        out.append(_choice(i, "text", text, None, None))
        out.append(_choice(i, "delta", chat_message(None, text), None, "stop" if i % 2 else None))
        out.append(_choice(i, "delta", chat_message(None, reasoning_content=text, reasoning=text), None, None))
    out.append(_choice(0, "delta", chat_message("assistant", ""), None, None))
    out.append(_choice(3, "delta", chat_message(None), None, "length"))
    out.append(_choice(1, "delta", chat_message(None, tool_calls=[
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": "é"}'}}]),
        None, None))
    lps = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": [
        {"token": t, "logprob": lp, "bytes": None}]} for t, lp in zip(TEXTS, [
            -0.0, 0.0, -1e-10, -123456.789, -0.1, -1 / 3, -2.5e-300, -9999999999.0, -0.5, -7.0, -1e16, -3.14, -2.0])]}
    out.append(_choice(0, "delta", chat_message(None, "x"), lps, None))
    out.append(_choice(2, "text", "y", {"tokens": ["y"], "token_logprobs": [-0.7], "top_logprobs": [{"y": -0.7}],
                                       "text_offset": [12]}, "stop"))
    return out


@pytest.mark.parametrize("renderer", [
    ChatRenderer(id="chatcmpl-0123", model="SmolLM2", fingerprint="fp_minisrv_0.1_torch"),
    ChatRenderer(id='chatcmpl-"odd"\\', model="model ü 日本 🎉", fingerprint=None, created=0),
    CompletionRenderer(id="cmpl-0123", model='a,"choices":[]', fingerprint="fp", include_usage=True),
])
def test_chunk_event_equals_the_envelope(renderer):
    for choice in choices():
        assert renderer.event(choice) == sse(renderer.frame(renderer.chunk, [choice])), choice


def test_request_output_crosses_the_pipe_unchanged():
    full = RequestOutput("cmpl-1-0", [5, 6], " a b", [TokenLogprob(5, -0.5, {5: -0.5, 7: -1.5})], [0, 2], True,
                         "stop", "b", 9, 3, "oops", "response_format", [None, TokenLogprob(1, -2.0, {})], [0.5, 1.5])
    bare = RequestOutput("r", [], "", [], [], False)
    for out in (full, bare):
        back = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        assert back == out and type(back) is RequestOutput


def test_text_chunk_template_equals_the_general_chunk():
    """The usual chunk (a piece of text alone) from its template, against the renderer's general path."""
    from minisrv.server.generation import Choice
    chat = ChatRenderer(id="chatcmpl-\x00text\x00", model="m \x00text\x00", fingerprint="fp")
    completion = CompletionRenderer(id="cmpl-1", model="\x00text\x00", fingerprint=None)
    for index in (0, 3, 12):
        choice = Choice(index)
        chat.opening(choice)
        completion.opening(choice)
        for text in TEXTS + ["\x00text\x00"]:
            assert chat.text_event(index, text) == chat.event(chat.text_choice(index, text))
            assert completion.text_event(index, text) == completion.event(completion.text_choice(index, text))
            general = [chat.event(_choice(index, "delta", chat_message(None, text), None, None))] if text else []
            assert chat.chunks(choice, text, [], None) == general
            general = [completion.event(_choice(index, "text", text, None, None))] if text else []
            assert completion.chunks(choice, text, [], None) == general
