"""The one text path: a request's output tokens -> its text, incrementally, as the engine samples them.

Every consumer (the offline `LLM`, the server's streams and whole responses) reads the text made here, so a prompt
gets the same text whichever way it is served. The text is never cut inside a UTF-8 character, ends before the
first stop string, and `take()` holds back a tail that may still become a stop string until it is known not to.

Decoding uses the tokenizer's own streaming decoder (`tokenizers.decoders.DecodeStream`), primed with the last
prompt tokens so a word-initial space comes out right; a tokenizer without one falls back to decoding a sliding
window of ids. Where the installed tokenizer's own `decode` cleans up spaces
(`clean_up_tokenization_spaces`, " ." -> "."; transformers 5 no longer does, whatever the flag says), the same
clean-up is applied to the stream, with a short tail held back where a pattern could still complete: the text is
always what `tokenizer.decode(ids, skip_special_tokens=True)` gives.

The text is kept as a list of pieces; only the tail a stop string can reach is joined as tokens arrive, and `take()`
joins only what it hands out, so a long output costs linear time.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # an older tokenizers: _WindowDecoder
    DecodeStream = None

PROMPT_CONTEXT = 5  # prompt tokens decoded alongside the output, so word-initial spaces come out right

# transformers' clean_up_tokenization, in its order
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_CLEANUP_HOLD = max(len(a) for a, _ in _CLEANUP) - 1  # a pattern can straddle at most this many trailing chars
_CLEANUP_PROBE = "a . b , c ! d ? e n't f 's"  # text whose decode shows whether a tokenizer cleans up spaces


def _cleanup(text: str) -> str:
    for a, b in _CLEANUP:
        text = text.replace(a, b)
    return text


class _WindowDecoder:
    """Fallback for tokenizers without a streaming decoder: decode a window of ids, emit what it adds."""

    def __init__(self, tokenizer: Any, context: Sequence[int], skip_special_tokens: bool) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: List[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> Optional[str]:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return None


def decode_cleans_up(tokenizer: Any) -> bool:
    """Whether the tokenizer's own decode applies the space clean-up (asked of its decode, not of its flag)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        ids = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False)
        return tokenizer.decode(ids, skip_special_tokens=True) != tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except Exception:  # noqa: BLE001 - a tokenizer without these arguments: it does not clean up
        return False


class TextStream:
    """One request's output text. Feed it every sampled token that is part of the text (`add`), then `finish()`.
    `clean_up`: whether the tokenizer's decode cleans up spaces (decode_cleans_up; asked here when None)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, clean_up: Optional[bool] = None) -> None:
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # a token's new text, or None while it is incomplete (the Rust DecodeStream holds back partial UTF-8 itself)
        self._decode: Callable[[int], Optional[str]]
        if backend is not None and DecodeStream is not None:
            self._decode = functools.partial(DecodeStream(ids=context, skip_special_tokens=skip_special_tokens).step,
                                             backend)
        else:
            self._decode = _WindowDecoder(tokenizer, context, skip_special_tokens).step
        self._cleanup = decode_cleans_up(tokenizer) if clean_up is None else clean_up
        self._raw_tail = ""  # decoded but not yet cleaned up (a clean-up pattern may still complete)
        self.stops = list(stop)
        self._reach = max((len(x) for x in self.stops), default=1) - 1  # trailing chars a stop string can span
        self._pieces: List[str] = []  # the text so far, in pieces (cut before the stop string once one is found)
        self._tail = ""  # its last `_reach` characters
        self.length = 0  # characters of text
        self.stop_str: Optional[str] = None  # the stop string that ended the text
        self.finished = False
        self._sent = 0  # characters of text already handed out by take()
        self._unsent: List[str] = []  # pieces (or parts) after the first `_sent` characters

    @property
    def text(self) -> str:
        """The whole text so far."""
        joined = "".join(self._pieces)
        self._pieces = [joined] if joined else []
        return joined

    def add(self, token_id: int) -> Optional[str]:
        """Append one token's text; returns the stop string if this token completed one (the text is cut there)."""
        if self.stop_str is not None:
            return self.stop_str
        piece = self._decode(token_id)
        if not piece:
            return None
        if self._cleanup:
            piece = self._clean(piece)
        return self._append(piece)

    def _clean(self, piece: str) -> str:
        """Clean up raw text in order, keeping back a tail that a later piece could turn into a pattern."""
        raw = self._raw_tail + piece
        keep = 0
        for k in range(min(_CLEANUP_HOLD, len(raw)), 0, -1):
            tail = raw[-k:]
            if tail[0] == " " and any(a.startswith(tail) for a, _ in _CLEANUP):
                keep = k
                break
        self._raw_tail = raw[len(raw) - keep:] if keep else ""
        return _cleanup(raw[:len(raw) - keep])

    def _append(self, piece: str) -> Optional[str]:
        if self.stops:
            window = self._tail + piece  # every stop string that ends in `piece` starts inside this window
            hit = find_stop(window, len(self._tail), self.stops)
            if hit is not None:
                cut = hit[0] - len(self._tail)  # where the text ends, relative to the piece (maybe before it)
                self.stop_str = hit[1]
                if cut < 0:
                    self._truncate(self.length + cut)
                    return self.stop_str
                piece = piece[:cut]
        if piece:
            self._pieces.append(piece)
            self._unsent.append(piece)
            self.length += len(piece)
            if self._reach:
                self._tail = (self._tail + piece)[-self._reach:]
        return self.stop_str

    def _truncate(self, length: int) -> None:
        """Cut the text to `length` characters (a stop string that began in earlier pieces); never below what
        take() has handed out, which never includes a possible stop string's start."""
        text = self.text[:length]
        self._pieces, self.length = [text], length
        self._tail = text[len(text) - self._reach:] if self._reach else ""
        self._unsent = [text[self._sent:]] if length > self._sent else []

    def finish(self) -> None:
        """The request ended: release what was held back for a clean-up pattern."""
        if not self.finished and self.stop_str is None and self._raw_tail:
            tail, self._raw_tail = self._raw_tail, ""
            self._append(_cleanup(tail))
        self.finished = True

    def take(self) -> str:
        """Text not handed out before that can be shown now: until the end, a tail that is the start of a stop
        string is held back."""
        end = self.length
        if not self.finished and self.stops:
            end -= partial_stop_len(self._tail, self.stops)
        if end <= self._sent:
            return ""
        unsent = "".join(self._unsent)
        out, rest = unsent[:end - self._sent], unsent[end - self._sent:]
        self._unsent = [rest] if rest else []
        self._sent = end
        return out


def find_stop(text: str, start: int, stops: Sequence[str]) -> Optional[Tuple[int, str]]:
    """Earliest stop string occurring in text that ends after `start`; returns (index, stop)."""
    best: Optional[Tuple[int, str]] = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string (held back when streaming)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
