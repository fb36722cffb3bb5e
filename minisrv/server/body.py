"""An HTTP body parsed and validated against its schema; one over INLINE_BODY_BYTES in a worker thread (and the
route then plans its prompts there too), so that the event loop stays free for /health and other streams."""
from __future__ import annotations

import asyncio
from typing import Any, Tuple

from fastapi import Request
from pydantic import ValidationError

from .errors import APIError, validation_message
from .http.json_body import parse as parse_json

INLINE_BODY_BYTES = 16384  # larger bodies are parsed, templated and tokenized in a worker thread


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
