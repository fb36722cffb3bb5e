"""A request body -> the JSON value it holds, strictly: what Python's json module would accept beyond RFC 8259, or
what would fail later in a way the client cannot make sense of, is a 400 here.

  - the body must be UTF-8 (a leading BOM is ignored, as RFC 8259 allows);
  - no NaN / Infinity / -Infinity literals, and no number that overflows a float (1e400 would become inf);
  - at most MAX_DEPTH nested arrays/objects, so that no later step (pydantic, the chat template, the response)
    recurses through a deep value; json's C decoder itself raises RecursionError near the interpreter's
    recursion limit (about 1,000 deep), which is answered the same way;
  - no lone UTF-16 surrogate escapes ("\\ud800"): such strings cannot be tokenized or encoded in a response.

The event loop. routes.py parses bodies over a few KiB in a worker thread, but json's C decoder holds the GIL
for as long as one call runs: 0.1-0.3 s for 8 MiB of the smallest values, all that time with /health and every
stream waiting. So a body over SPLIT_BYTES is parsed in pieces of at most PIECE_BYTES (a few ms each), with
the GIL free in between: one vectorized pass (numpy, which releases the GIL) finds its structure outside strings
(brackets, commas, colons, and so the nesting depth, checked before anything is parsed), and each array/object
larger than a piece is parsed as runs of its members that fit in a piece, recursing into a member that does
not. The result is json.loads's. Second, the millions of lists/dicts such a body can make would set off the
cyclic GC again and again, each pass walking all of them with the GIL held (2 s for 7 MB of `[]`): `parse`
pauses the GC while it parses and validates, and lets go of the parsed value before the GC resumes.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import re
import threading
from typing import Any, Callable, Iterator, List, TypeVar

from ..errors import APIError

MAX_DEPTH = 64
SPLIT_BYTES = 1 << 20  # larger bodies are parsed in pieces
PIECE_BYTES = 1 << 17  # about 5 ms of json's decoder at worst
MAX_CONTAINERS = 100_000  # arrays/objects in a body over SPLIT_BYTES: far more than any request that fits a context
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff: a pair is fine, a lone one is not
_BOM = b"\xef\xbb\xbf"
T = TypeVar("T")


class GCPause:
    """No automatic cyclic GC while any thread is inside `paused()`. The GC switch is process-wide, so the count of
    threads inside is too: one instance serves the process (GC_PAUSE)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._was_enabled = False

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
gc_paused = GC_PAUSE.paused


class _NotFinite(ValueError):
    pass


def _constant(name: str) -> Any:
    raise _NotFinite(f"{name} is not valid JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(f"the number {text[:40]} is out of range")
    return value


def _loads(piece: bytes) -> Any:
    return json.loads(piece.decode("utf-8"), parse_constant=_constant, parse_float=_float)


def _too_deep(max_depth: int) -> APIError:
    return APIError(400, f"request body nests too deeply (more than {max_depth} levels of arrays/objects)")


def _invalid(detail: str) -> APIError:
    return APIError(400, f"request body is not valid JSON: {detail}")


def _valid_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_value(data: Any, max_depth: int = MAX_DEPTH, check_strings: bool = True) -> None:
    """Raise an APIError if `data` nests more than `max_depth` containers deep, or (check_strings) holds a string
    or key with a lone surrogate. Iterative: a deep value cannot exhaust the stack here."""
    stack = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, dict):
            if check_strings and not all(_valid_text(k) for k in obj):
                raise APIError(400, "request body: a string holds an unpaired UTF-16 surrogate escape")
            items = obj.values()
        elif isinstance(obj, list):
            items = obj
        else:
            if check_strings and isinstance(obj, str) and not _valid_text(obj):
                raise APIError(400, "request body: a string holds an unpaired UTF-16 surrogate escape")
            continue
        if depth > max_depth:
            raise _too_deep(max_depth)
        for x in items:
            if isinstance(x, (dict, list)):
                stack.append((x, depth + 1))
            elif check_strings and isinstance(x, str) and not _valid_text(x):
                raise APIError(400, "request body: a string holds an unpaired UTF-16 surrogate escape")


def decode_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of a request body; raises an APIError (400) saying what is wrong with it."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}") from None
    raw = raw.removeprefix(_BOM)
    try:
        if len(raw) > SPLIT_BYTES:
            data = _Pieces(raw, max_depth).value()
        else:
            data = _loads(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except _NotFinite as e:
        raise APIError(400, f"request body: {e}") from None
    except ValueError as e:  # JSONDecodeError, an integer with too many digits
        raise _invalid(str(e)) from None
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    # depth: a large body's was checked from its structure; a small one's only matters past max_depth brackets
    if surrogates or (len(raw) <= SPLIT_BYTES and raw.count(b"[") + raw.count(b"{") > max_depth):
        check_value(data, max_depth, check_strings=surrogates)
    return data


def _kinds() -> Any:
    import numpy as np

    kind = np.zeros(256, dtype=np.int8)
    kind[[ord("["), ord("{")]] = 1
    kind[[ord("]"), ord("}")]] = -1
    kind[[ord(","), ord(":")]] = 2
    return kind


class _Pieces:
    """A large JSON text parsed in pieces (see the module's doc). Positions are byte offsets; every cut falls on
    an ASCII bracket, comma or colon outside strings, so each piece is valid UTF-8 and parses as json would."""

    def __init__(self, raw: bytes, max_depth: int) -> None:
        import numpy as np

        self.np, self.raw = np, raw
        # escaped backslashes, then escaped quotes, blanked at the same length (pairs from the left, as JSON
        # reads them): every quote left opens or closes a string
        masked = raw.replace(b"\\\\", b"..").replace(b'\\"', b"..")
        a = np.frombuffer(masked, dtype=np.uint8)
        inside = (np.cumsum(a == ord('"'), dtype=np.uint8) & 1).view(bool)  # the count's parity (wraps: fine)
        k = _kinds()[a]
        k[inside] = 0
        del inside, masked
        self.pos = np.flatnonzero(k)  # the structural characters
        step = k[self.pos]
        self.chars = a[self.pos]
        del a, k
        containers = int(np.count_nonzero(step == 1))
        if containers > MAX_CONTAINERS:
            raise APIError(400, f"request body holds more than {MAX_CONTAINERS} arrays/objects ({containers})")
        self.depth = np.cumsum(np.where(step == 2, 0, step), dtype=np.int32)  # after each structural char
        if len(self.pos) and int(self.depth.max()) > max_depth:
            raise _too_deep(max_depth)

    def value(self) -> Any:
        raw, pos, depth = self.raw, self.pos, self.depth
        n = len(pos)
        if n == 0 or raw[pos[0]] not in b"[{":  # a scalar, or not JSON: json says which
            return _loads(raw)
        if raw[:pos[0]].strip() or raw[pos[-1] + 1:].strip():
            raise _invalid("extra data around the value")
        if int(depth.min()) < 0 or depth[-1] != 0 or int(self.np.count_nonzero(depth[:-1] == 0)):
            raise _invalid("unbalanced brackets, or extra data")
        return self._container(0, n - 1)

    def _container(self, i: int, j: int) -> Any:
        """The array/object opened by structural char i and closed by j."""
        np, raw, pos, chars, depth = self.np, self.raw, self.pos, self.chars, self.depth
        start, end = int(pos[i]), int(pos[j]) + 1
        if end - start <= PIECE_BYTES:
            return _loads(raw[start:end])
        is_list = chars[i] == ord("[")
        if chars[j] != (ord("]") if is_list else ord("}")):
            raise _invalid(f"mismatched brackets at byte {start} and {end - 1}")
        d = depth[i]
        inner = slice(i + 1, j)
        commas = np.flatnonzero((depth[inner] == d) & (chars[inner] == ord(","))) + (i + 1)
        bounds = np.concatenate(([i], commas, [j]))  # structural indices around each member
        if len(bounds) == 2 and not raw[start + 1:end - 1].strip():
            return [] if is_list else {}
        edges = pos[bounds]
        spans = np.diff(edges)  # a member's bytes, with one separator
        cum = np.cumsum(spans)
        big = np.flatnonzero(spans > PIECE_BYTES)
        out: Any = [] if is_list else {}
        m, members = 0, len(spans)
        while m < members:
            next_big = big[np.searchsorted(big, m)] if len(big) and big[-1] >= m else members
            if next_big == m:  # one member larger than a piece
                member = self._member(int(bounds[m]), int(bounds[m + 1]), is_list)
                if is_list:
                    out.append(member)
                else:
                    out.update(member)
                m += 1
                continue
            budget = (cum[m - 1] if m else 0) + PIECE_BYTES
            last = max(m, min(int(np.searchsorted(cum, budget, side="right")) - 1, int(next_big) - 1))
            run = raw[int(edges[m]) + 1:int(edges[last + 1])]
            if is_list:
                part = _loads(b"[" + run + b"]")
                if len(part) != last - m + 1:  # an empty member (a lone one is no error to json)
                    raise _invalid(f"an empty array member near byte {int(edges[m])}")
                out.extend(part)
            else:
                part = _loads(b"{" + run + b"}")
                if last == m and len(part) != 1:
                    raise _invalid(f"an empty object member near byte {int(edges[m])}")
                out.update(part)
            m = last + 1
        return out

    def _member(self, a: int, b: int, is_list: bool) -> Any:
        """The member between structural chars a and b (separators): a value, or for an object {key: value}."""
        np, raw, pos, chars, depth = self.np, self.raw, self.pos, self.chars, self.depth
        d = depth[a]  # the container's inner depth (after its opener, or at one of its commas)
        lo = a + 1
        if not is_list:
            colons = np.flatnonzero((depth[lo:b] == d) & (chars[lo:b] == ord(":")))
            if not len(colons):
                raise _invalid(f"an object member without a colon near byte {int(pos[a])}")
            colon = lo + int(colons[0])
            key = _loads(raw[int(pos[a]) + 1:int(pos[colon])])
            if not isinstance(key, str):
                raise _invalid(f"an object key is not a string near byte {int(pos[a])}")
            return {key: self._value(colon, b)}
        return self._value(a, b)

    def _value(self, a: int, b: int) -> Any:
        """The value between structural chars a and b: a scalar, or one array/object."""
        raw, pos, chars = self.raw, self.pos, self.chars
        if b == a + 1:  # no structure inside: a scalar (a long string, say)
            return _loads(raw[int(pos[a]) + 1:int(pos[b])])
        first, last = a + 1, b - 1
        if chars[first] not in b"[{" or raw[int(pos[a]) + 1:int(pos[first])].strip() \
                or raw[int(pos[last]) + 1:int(pos[b])].strip():
            raise _invalid(f"unexpected data near byte {int(pos[a])}")
        if self.depth[last] != self.depth[first] - 1 or \
                int(self.np.count_nonzero(self.depth[first:last] < self.depth[first])):
            raise _invalid(f"more than one value near byte {int(pos[a])}")
        return self._container(first, last)


def parse(raw: bytes, validate: Callable[[Any], T]) -> T:
    """validate(decode_json(raw)), with the GC paused; raises the APIError of either."""
    with gc_paused():
        try:
            return validate(decode_json(raw))
        except APIError as e:
            # its traceback's frames hold the parsed value: dropped here, while the GC is still paused
            err = e.with_traceback(None)
    raise err


__all__: List[str] = ["MAX_DEPTH", "check_value", "decode_json", "gc_paused", "parse"]
