"""Texts into prompt token ids, and chat messages into a prompt text: the one place a chat template is applied (every
API's chat request, /tokenize's chat form, count_tokens and the offline `LLM.chat`: a count is the prompt a
generation gets). `PromptMaker` holds the tokenizer and what is derived from it once; for a gpt-oss model (its
config's model_type) that is the harmony encoding, which renders its prompts in place of a chat template. A text over
ASYNC_ENCODE_CHARS is tokenized off the event loop (`off_loop`); one whose length already proves it over the limit
is refused untokenized (`max_token_chars`). Nothing here imports the HTTP layer."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from minisrv.engine.request import RequestError

from .reasoning import ReasoningFormat, chat_template_text, resolve_reasoning
from .tools import parser_for

logger = logging.getLogger("minisrv.server")

ASYNC_ENCODE_CHARS = 16384  # longer texts are tokenized in a worker thread
# names a client's chat_template_kwargs may not use: the template's own inputs, set by the server
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "chat_template", "tools", "documents"})
# tools for a template that ignores them (the default SmolLM2's among them: the model would never learn of them): they
# and the call format go into a system prompt, as llama.cpp's server does, in the hermes format tools.py reads back
PROBE_MESSAGES = [{"role": "user", "content": "What is the weather?"}]
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool_name", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}]
TOOL_INSTRUCTIONS = ("You may call the functions below. To call one, answer with only\n"
                "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>\n"
                "(one block per call). Otherwise, answer normally.\n\nFunctions:\n")


async def off_loop(offload: bool, fn: Callable[[], Any]) -> Any:
    """fn() in a worker thread when it may take long (so the event loop keeps serving), else here."""
    return await asyncio.to_thread(fn) if offload else fn()


@dataclass(frozen=True)
class PromptMaker:
    """The served model's tokenizer and what the plan derives from it once."""

    tokenizer: Any
    tool_parser: str = "hermes"  # the tool-call format the template teaches (tools.py)
    reasoning: Optional[ReasoningFormat] = None  # the reasoning parser, None: the model's thinking stays as text
    tools_in_template: bool = True  # False: the template ignores tools; they go in a system prompt (with_tool_prompt)
    max_token_chars: Optional[int] = None  # see max_token_chars(); None: no early length check
    harmony: Any = None  # gpt-oss's harmony encoding (harmony.py), which makes its prompts and reads its outputs

    @classmethod
    def of(cls, tokenizer: Any, tool_call_parser: str = "auto", reasoning_parser: Optional[str] = None
           ) -> "PromptMaker":
        """Derived from the tokenizer; raises ValueError for a reasoning parser it cannot serve."""
        if model_type(tokenizer) == "gpt_oss":
            from .harmony import load_encoding  # openai-harmony is imported where a harmony model is served
            logger.info("chat format: harmony (the tool-call and reasoning parsers are harmony's)")
            return cls(tokenizer, "harmony", None, True, max_token_chars(tokenizer), load_encoding())
        reasoning = resolve_reasoning(reasoning_parser, tokenizer)
        reads_tools = template_reads_tools(tokenizer)
        logger.info("tools reach the model %s", "through its chat template" if reads_tools else
                    "in a system prompt (its chat template ignores them)")
        return cls(tokenizer, parser_for(chat_template_text(tokenizer), tool_call_parser), reasoning, reads_tools,
                   max_token_chars(tokenizer))

    def encode(self, text: str, add_special_tokens: bool, param: str, limit: Optional[int] = None) -> List[int]:
        """Tokenize a prompt text, unless its length alone proves it longer than `limit` tokens (a 400)."""
        per_token = self.max_token_chars
        if limit is not None and per_token and len(text) > limit * per_token:
            at_least = math.ceil(len(text) / per_token)
            raise RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                               f"{len(text)} characters, which are at least {at_least} tokens.", param,
                               "context_length_exceeded")
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def check_template_kwargs(self, kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """A request's chat_template_kwargs (extra template variables, e.g. Qwen3's enable_thinking). Names of
        apply_chat_template's own arguments, and of what the server sets (messages, tools, a template of the
        client's own), are refused: they would change how the prompt is made, not what the template says."""
        if not kwargs:
            return {}
        own = set(inspect.signature(self.tokenizer.apply_chat_template).parameters) | RESERVED_TEMPLATE_KWARGS
        for key in kwargs:
            if not key.isidentifier() or key in own:
                raise RequestError(f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
        return dict(kwargs)

    def template(self, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]] = None,
                 kwargs: Optional[Dict[str, Any]] = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False) -> str:
        """The prompt text of chat messages (content strings; assistant tool_calls with JSON-string arguments, as OpenAI
sends them) and function tools; a template that ignores tools gets them in a system prompt. A system message is
templated in its place (agent clients put reminders mid-conversation); for a template that refuses a later system
message, those are joined into the first one and the prompt is made again."""
        if chat_template_text(self.tokenizer) is None:
            raise RequestError("this model's tokenizer has no chat template; use /v1/completions", "messages")
        msgs = _arguments_as_objects(messages)
        extra = dict(kwargs or {})
        if tools is not None:
            if self.tools_in_template:
                extra["tools"] = tools
            else:
                msgs = with_tool_prompt(msgs, tools)

        def render(ms: List[Dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(ms, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      tokenize=False, **extra)
        try:
            return render(msgs)
        except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception, bad roles) are the client's
            error = e
        merged = systems_first(msgs)
        if merged is not None:
            with contextlib.suppress(Exception):  # the first error says more
                return render(merged)
        raise RequestError(f"chat template failed: {error}", "messages")


def model_type(tokenizer: Any) -> Optional[str]:
    """The model_type in the config.json beside the tokenizer's files, or None."""
    folder = getattr(tokenizer, "name_or_path", None)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, TypeError, ValueError, AttributeError):
        return None


def systems_first(messages: List[Dict[str, Any]]) -> Optional[List[Dict[str, Any]]]:
    """The messages with every system message after the first message joined into the leading one (a new one when
    the conversation does not start with one); None when there is none to move."""
    later = [i for i, m in enumerate(messages) if m.get("role") == "system" and i > 0]
    if not later:
        return None
    texts = [str(messages[i].get("content") or "") for i in later]
    rest = [m for i, m in enumerate(messages) if i not in set(later)]
    if rest and rest[0].get("role") == "system":
        head = {**rest[0], "content": "\n\n".join([str(rest[0].get("content") or "")] + texts)}
        return [head] + rest[1:]
    return [{"role": "system", "content": "\n\n".join(texts)}] + rest


def _arguments_as_objects(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Assistant tool_calls carry their arguments as JSON strings (OpenAI); templates expect objects."""
    def as_object(call: Dict[str, Any]) -> Dict[str, Any]:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            with contextlib.suppress(ValueError):
                fn["arguments"] = json.loads(fn["arguments"])
        return {**call, "function": fn}

    return [{**m, "tool_calls": [as_object(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def max_token_chars(tokenizer: Any) -> Optional[int]:
    """The most characters of input text one token can stand for, where the tokenizer makes that provable (else None):
a text of c characters is then at least ceil(c / max_token_chars) tokens.

Provable for a byte-level BPE without a normalizer (GPT-2, Llama 3, SmolLM2, ...): pre-tokenizers that keep every
byte, each token one vocabulary entry of one character per byte, an added token its literal content; so a token
covers at most as many characters as it has bytes. (A fixed ratio would not do: SmolLM2 has a token of a newline
and 80 spaces.) A normalizer can shrink the text, so with one there is no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
            return None
        if not any(p.get("type") == "ByteLevel" for p in parts):
            return None
        if any(p.get("type") not in ("ByteLevel", "Split", "Digits") or p.get("behavior") == "Removed" for p in parts):
            return None
        vocab = backend.get_vocab(with_added_tokens=False)
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        return max([len(s) for s in vocab] + [len(a.encode("utf-8")) for a in added])
    except Exception:  # noqa: BLE001 - an unexpected tokenizer: no early check, tokenizing still works
        return None


def template_reads_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template puts the tools it is given into the prompt (a probe rendered with and
    without one tool). A template that fails on the probe counts as reading them: nothing is added then."""
    try:
        plain = tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
        with_tools = tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False,
                                                   tools=PROBE_TOOLS)
    except Exception:  # noqa: BLE001 - no template, or one that needs other messages: leave tools to it
        return True
    return plain != with_tools


def with_tool_prompt(messages: List[Dict[str, Any]], tools: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The messages with the tools and the call format in the system prompt (added to the first system message, or
    a new one first)."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    text = TOOL_INSTRUCTIONS + listing
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
