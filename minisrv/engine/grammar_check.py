"""A request's grammar checked without compiling it (no tokenizer, no torch): what the HTTP side needs to answer
an invalid schema, regex or EBNF with a 400 before the request is queued. The grammar engine itself is
engine/grammar.py; this module is apart so that the HTTP process does not import torch."""
from __future__ import annotations

import functools
import re
from typing import Optional, Tuple

from .request import RequestError, SamplingParams

CACHE_ENTRIES = 256  # compiled grammars kept by (kind, text); live requests hold theirs beyond that
# JSON grammars admit at most this many whitespace characters in a row between tokens. Unbounded, a weak model
# (small, or random) can spend every token it has on whitespace after a "{" and never write the object; bounded,
# pretty-printed JSON still fits (a newline and 31 spaces: depth 7 at indent 4), and nothing else changes.
MAX_JSON_WHITESPACE = 32
PARAM = "response_format"  # where an invalid grammar is reported (the OpenAI request field that carries it)


def constraint_of(params: SamplingParams) -> Optional[Tuple[str, str]]:
    """The (kind, text) of a request's grammar, or None. SamplingParams.validate allows at most one."""
    if params.json_object:
        return "json_object", ""
    for kind in ("json_schema", "regex", "ebnf"):
        if getattr(params, kind) is not None:
            return kind, getattr(params, kind)
    return None


_XGR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")  # "[01:54:56] /project/cpp/foo.cc:83: "


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without its log prefix (time, C++ source file and line)."""
    text = _XGR_PREFIX.sub("", str(e)).strip()
    return text or type(e).__name__


def check_grammar(params: SamplingParams) -> None:
    """Parse a request's grammar without compiling it against a vocabulary (no tokenizer needed, milliseconds):
    for the HTTP side, to turn an invalid schema, regex or EBNF into a 400 before the request is queued. Raises
    RequestError(param="response_format")."""
    key = constraint_of(params)
    if key is None:
        return
    why = grammar_error(*key)
    if why is not None:
        raise RequestError(f"invalid {key[0]}: {why}", PARAM)


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def grammar_error(kind: str, text: str) -> Optional[str]:
    """Why xgrammar cannot parse a grammar of this kind ("json_schema", "json_object", "regex", "ebnf"), or None.
    Cached: a client resends the same schemas (its tools, with every turn of a chat)."""
    import xgrammar as xgr
    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(text, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError (and ValueError) for a bad grammar
        return xgrammar_message(e)
    return None
