"""An OpenAI-style request's sampling fields as SamplingParams fields: the plain ones, logit_bias, and its one output
constraint however it is given (response_format, SGLang's regex / ebnf / choices, vLLM's guided_choice and
structured_outputs)."""
from __future__ import annotations

import contextlib
import json
from typing import Any, Dict, Iterator, Mapping

from minisrv.engine.request import RequestError

# request fields passed to SamplingParams as they are; one left out (None) gets SamplingParams' default, so
# /v1/completions without max_tokens gets its 16 (OpenAI's default too)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
                   "skip_special_tokens")
CONSTRAINTS = ("json_schema", "json_object", "regex", "ebnf")
# a SamplingParams field's name in an OpenAI request (a 400's param)
OPENAI_NAMES = {"json_schema": "response_format", "json_object": "response_format"}


def sampling_fields(body: Any) -> Dict[str, Any]:
    """The request's sampling fields, logit_bias and its one output constraint, as SamplingParams keyword arguments."""
    plain = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    if body.logit_bias:
        try:
            plain["logit_bias"] = {int(t): v for t, v in body.logit_bias.items()}
        except ValueError:
            raise RequestError("logit_bias keys must be token ids", "logit_bias") from None
    kw: Dict[str, Any] = {}  # the constraint
    rf = body.response_format
    if rf is not None:
        spec = rf.get("json_schema")
        kw.update(output_format(rf.get("type", "text"), spec.get("schema") if isinstance(spec, dict) else None,
                                "response_format", "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}"))
    kw.update({name: getattr(body, name) for name in ("regex", "ebnf") if getattr(body, name) is not None})
    guided_choice = body.guided_choice
    if body.structured_outputs is not None:
        guided_choice = _vllm_structured_outputs(body.structured_outputs, kw, guided_choice)
    choice = choice_grammar(guided_choice, body.choices)
    if choice is not None:
        if "ebnf" in kw:
            raise RequestError("give choices or ebnf, not both", "ebnf")
        kw["ebnf"] = choice
    return {**plain, **kw}


def output_format(kind: Any, schema: Any, where: str, schema_shape: str) -> Dict[str, Any]:
    """An output format (text, json_object or json_schema with its schema) as SamplingParams' constraint fields;
    `where`: the request's field (a 400 names its top-level one), `schema_shape`: where in it the schema goes."""
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    param = where.split(".")[0]
    if kind != "json_schema":
        raise RequestError(f"{where} type must be text, json_object or json_schema, got {kind!r}", param)
    if not isinstance(schema, dict):
        raise RequestError(f"{where} json_schema needs {schema_shape}", param)
    return {"json_schema": json.dumps(schema)}


def _vllm_structured_outputs(spec: Dict[str, Any], kw: Dict[str, Any], guided_choice: Any) -> Any:
    """vLLM's `structured_outputs` ({"choice": [...]} or "regex", "json", "grammar") into kw as the fields above
    would set it; returns the choice list. One constraint in all, whichever way it is given (a 400 otherwise)."""
    known = {"choice", "regex", "json", "grammar"}
    given = [k for k in spec if spec[k] is not None]
    if len(given) != 1 or given[0] not in known:
        raise RequestError(f"structured_outputs takes one of {', '.join(sorted(known))}", "structured_outputs")
    key, value = given[0], spec[given[0]]
    if kw or guided_choice is not None:
        raise RequestError("give structured_outputs or another constraint, not both", "structured_outputs")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError("structured_outputs.choice must be a non-empty list of non-empty strings",
                               "structured_outputs")
        return value
    if key == "json":
        if not isinstance(value, (dict, str)):
            raise RequestError("structured_outputs.json must be a JSON schema", "structured_outputs")
        kw["json_schema"] = value if isinstance(value, str) else json.dumps(value)
    else:
        kw["regex" if key == "regex" else "ebnf"] = value
    return guided_choice


def choice_grammar(guided_choice: Any, choices: Any) -> Any:
    """vLLM's guided_choice / SGLang's choices as an EBNF grammar whose only sentences are the given strings (each
    a JSON-escaped literal, which xgrammar's EBNF reads), or None when neither is given."""
    if guided_choice is not None and choices is not None:
        raise RequestError("give guided_choice or choices, not both", "choices")
    given, name = (guided_choice, "guided_choice") if guided_choice is not None else (choices, "choices")
    if given is None:
        return None
    if not given or not all(isinstance(c, str) and c for c in given):
        raise RequestError(f"{name} must be a non-empty list of non-empty strings", name)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(given))


@contextlib.contextmanager
def fields_named(names: Mapping[str, str]) -> Iterator[None]:
    """A RequestError about a SamplingParams (or chat) field names the request field that set it (param)."""
    try:
        yield
    except RequestError as e:
        e.param = names.get(e.param, e.param)
        raise
