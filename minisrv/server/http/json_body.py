"""A request body -> the JSON value it holds, strictly, by msgspec, then its route's schema (`parse_body`).

msgspec refuses what Python's json module would accept beyond RFC 8259, or what would fail later in a way the client
cannot make sense of: NaN / Infinity, a number that overflows a float, lone UTF-16 surrogate escapes, invalid UTF-8;
each a 400 saying what and where. A leading BOM is ignored, as RFC 8259 allows. What msgspec lacks is checked from
the bytes first (`shape`): at most MAX_DEPTH levels of nesting (pydantic, the chat template and the grammar compiler
all walk a value; a schema's compile time grows steeply with its depth), and at most MAX_CONTAINERS arrays/objects
(msgspec builds them in one call that holds the GIL: millions of `[]` would stall the event loop).

The cyclic GC: a body of many lists sets off full collections while it is parsed, each walking the whole heap with
the GIL held, so `parse` pauses the GC (process-wide, so the pause is counted) and lets go of the parsed value
before it resumes."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import threading
from typing import Any, Callable, Iterator, Tuple, TypeVar

import msgspec
import numpy as np
from fastapi import Request
from pydantic import ValidationError

from ..errors import APIError, validation_message

MAX_DEPTH = 64
MAX_CONTAINERS = 100_000  # far more than any request that fits a context
INLINE_BODY_BYTES = 16384  # larger bodies are parsed, templated and tokenized in a worker thread
_BOM = b"\xef\xbb\xbf"
_DECODER = msgspec.json.Decoder()
_AT_BYTE = re.compile(r"\(byte (\d+)\)")
# a high surrogate escape (\ud800-\udbff) that no low one (\udc00-\udfff) follows, escaped backslashes blanked
_LONE_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
T = TypeVar("T")


class GCPause:
    """No automatic cyclic GC while any thread is inside `paused()`. The GC switch is process-wide, so the count of
    threads inside is too: one instance serves the process (GC_PAUSE)."""

    def __init__(self) -> None:
        self._lock, self._inside, self._was_enabled = threading.Lock(), 0, False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            if self._inside == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0 and self._was_enabled:
                    gc.enable()


GC_PAUSE = GCPause()


def _unescaped(raw: bytes) -> bytes:
    """raw with escaped backslashes, then escaped quotes, blanked at the same length (pairs from the left, as
    JSON reads them): every quote left opens or closes a string, every backslash left starts an escape."""
    return raw.replace(b"\\\\", b"..").replace(b'\\"', b"..")


def shape(raw: bytes) -> Tuple[int, int]:
    """(arrays/objects, deepest nesting) of a JSON text, from its brackets outside strings. In numpy, which
    releases the GIL for these passes."""
    a = np.frombuffer(_unescaped(raw), dtype=np.uint8)
    opens = (a == ord("[")) | (a == ord("{"))
    at = np.flatnonzero(opens | (a == ord("]")) | (a == ord("}")))  # brackets, those in strings too
    at = at[(np.searchsorted(np.flatnonzero(a == ord('"')), at) & 1) == 0]  # those after an even count of quotes
    step = np.where(opens[at], 1, -1)
    return int(np.count_nonzero(step == 1)), int(np.cumsum(step).max(initial=0))


def _invalid(raw: bytes, e: Exception) -> APIError:
    detail = str(e).removeprefix("JSON is malformed: ")
    if detail == "Input data was truncated" and _LONE_HIGH_SURROGATE.search(_unescaped(raw)):
        return APIError(400, "request body: a string holds an unpaired UTF-16 surrogate escape")
    at = _AT_BYTE.search(detail)
    if at:  # the text around the fault, which names it (NaN, -Infinity, ...)
        pos = int(at.group(1))
        detail += f" near {raw[max(pos - 12, 0):pos + 12].decode('utf-8', 'replace')!r}"
    return APIError(400, f"request body is not valid JSON: {detail}")


def decode_json(raw: bytes, max_depth: int = MAX_DEPTH, max_containers: int = MAX_CONTAINERS) -> Any:
    """The JSON value of a request body; raises an APIError (400) saying what is wrong with it."""
    raw = raw.removeprefix(_BOM)
    if raw.count(b"[") + raw.count(b"{") > min(max_depth, max_containers):  # else no limit can be reached
        containers, depth = shape(raw)
        if depth > max_depth:
            raise APIError(400, f"request body nests too deeply (more than {max_depth} levels of arrays/objects)")
        if containers > max_containers:
            raise APIError(400, f"request body holds more than {max_containers} arrays/objects ({containers})")
    try:
        return _DECODER.decode(raw)
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as e:  # ValidationError: a number out of range
        raise _invalid(raw, e) from None


def parse(raw: bytes, validate: Callable[[Any], T]) -> T:
    """validate(decode_json(raw)), with the GC paused; raises the APIError of either."""
    with GC_PAUSE.paused():
        try:
            return validate(decode_json(raw))
        except APIError as e:
            # its traceback's frames hold the parsed value: dropped here, while the GC is still paused
            err = e.with_traceback(None)
    raise err


async def parse_body(request: Request, schema: type) -> Tuple[Any, bool]:
    """A route's JSON body as `schema` (the Gate has checked its type and declared size); also whether it is large:
    parsed in a worker thread, as the route then plans its prompts (the event loop stays free for /health and the
    streams of others)."""
    raw = await request.body()

    def validate(data: Any) -> Any:
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            msg, param = validation_message(e)
        raise APIError(400, msg, param=param)  # outside the except: no __context__ holding the input

    if len(raw) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(parse, raw, validate), True
    return parse(raw, validate), False
