"""From an HTTP body to what the engine takes: the body parsed and validated against its schema, chat messages made
ready for the template, prompt texts tokenized, and the slow parts of that kept off the event loop.

Keeping the event loop free (so /health and the streams of others never wait): a body over INLINE_BODY_BYTES is
parsed, validated, templated and tokenized in a worker thread, and so is a text over ASYNC_ENCODE_CHARS, and the
check of a request's grammar or tools' schemas (its first use imports the grammar engine, and torch with it); a prompt
whose length in characters already proves it longer than the model's limit is refused before it is tokenized
(state.max_token_chars).
"""
from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any, Callable, Dict, List, Tuple

from fastapi import Request
from pydantic import ValidationError

from minisrv.engine.request import RequestError

from .errors import APIError, validation_message
from .http.json_body import parse as parse_json
from .state import ServerState

# names a client's chat_template_kwargs may not use: the template's own inputs, set by the server
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "chat_template", "tools", "documents"})
INLINE_BODY_BYTES = 16384  # larger bodies are parsed, templated and tokenized in a worker thread
ASYNC_ENCODE_CHARS = 16384  # so are longer texts (a chat template can make a long text of a short body)


async def parse_body(request: Request, schema: type) -> Tuple[Any, bool]:
    """JSON body -> schema (the Gate has checked that it is declared application/json and not too large); also
    whether it is large, i.e. parsed in a worker thread (as the prompts made of it are then)."""
    raw = await request.body()

    def validate(data: Any) -> Any:
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            msg, param = validation_message(e)
        raise APIError(400, msg, param=param)  # outside the except: no __context__ holding the input

    if len(raw) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(parse_json, raw, validate), True
    return parse_json(raw, validate), False


def encode(state: ServerState, text: str, add_special_tokens: bool, param: str) -> List[int]:
    """Tokenize a prompt text, unless its length alone proves it too long for the model (a 400)."""
    limit = state.info.max_request_len
    per_token = state.max_token_chars
    if per_token and len(text) > limit * per_token:
        at_least = math.ceil(len(text) / per_token)
        raise RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                           f"{len(text)} characters, which are at least {at_least} tokens.", param,
                           "context_length_exceeded")
    return state.tokenizer(text, add_special_tokens=add_special_tokens).input_ids


async def off_loop(offload: bool, fn: Callable[[], Any]) -> Any:
    """fn() in a worker thread when it may take long (so the event loop keeps serving), else here."""
    return await asyncio.to_thread(fn) if offload else fn()


def template_messages(body: Any) -> List[Dict[str, Any]]:
    """The request's messages as the chat template takes them: text parts joined, the developer role as system."""
    msgs = []
    for i, msg in enumerate(body.messages):
        d = msg.model_dump(exclude_none=True)
        content = msg.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                                   param="messages")
                parts.append(part.text)
            content = "".join(parts)
        d["content"] = content or ""
        if d["role"] == "developer":
            d["role"] = "system"
        msgs.append(d)
    return msgs


def template_kwargs(tokenizer: Any, kwargs: Any) -> Dict[str, Any]:
    """A request's chat_template_kwargs (extra variables for the chat template, e.g. Qwen3's enable_thinking), as
    apply_chat_template takes them. Names of apply_chat_template's own arguments, and of what the server sets
    (messages, tools, a template of the client's own), are refused: they would change how the prompt is made, not
    what the template says. A 400 (APIError) otherwise."""
    if not kwargs:
        return {}
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) | RESERVED_TEMPLATE_KWARGS
    for key in kwargs:
        if not key.isidentifier() or key in own:
            raise APIError(400, f"chat_template_kwargs may not set {key!r}", param="chat_template_kwargs")
    return dict(kwargs)
