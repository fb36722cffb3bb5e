"""The one text path: a request's output tokens -> its text, incrementally, as the engine samples them.

Every consumer (the offline `LLM`, the server's streams and whole responses) reads the text made here, so a prompt
gets the same text whichever way it is served. The text is never cut inside a UTF-8 character, ends before the
first stop string, and `take()` holds back a tail that may still become a stop string until it is known not to.

Decoding uses the tokenizer's own streaming decoder (`tokenizers.decoders.DecodeStream`, about 1.5 us a token),
primed with the last prompt tokens so a word-initial space comes out right; a tokenizer without one falls back to
decoding a sliding window of ids. Tokenizers that clean up spaces (`clean_up_tokenization_spaces`, " ." -> ".")
get the same clean-up applied to the stream, with a short tail held back where a pattern could still complete.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

PROMPT_CONTEXT = 5  # prompt tokens decoded alongside the output, so word-initial spaces come out right

# transformers' clean_up_tokenization, in its order
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_CLEANUP_HOLD = max(len(a) for a, _ in _CLEANUP) - 1  # a pattern can straddle at most this many trailing chars


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


class _StreamDecoder:
    """The Rust tokenizer's DecodeStream: holds back incomplete UTF-8 itself."""

    def __init__(self, backend: Any, context: Sequence[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream
        self.backend = backend
        self.stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> Optional[str]:
        return self.stream.step(self.backend, token_id)


def _has_decode_stream() -> bool:
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:
        return False
    return True


_DECODE_STREAM = _has_decode_stream()


class TextStream:
    """One request's output text. Feed it every sampled token that is part of the text (`add`), then `finish()`."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and _DECODE_STREAM:
            self._decoder: Any = _StreamDecoder(backend, context, skip_special_tokens)
        else:
            self._decoder = _WindowDecoder(tokenizer, context, skip_special_tokens)
        self._cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._raw_tail = ""  # decoded but not yet cleaned up (a clean-up pattern may still complete)
        self.stops = list(stop)
        self.text = ""  # the text so far (cut before the stop string once one is found)
        self.stop_str: Optional[str] = None  # the stop string that ended the text
        self.finished = False
        self._sent = 0  # characters of text already handed out by take()

    def add(self, token_id: int) -> Optional[str]:
        """Append one token's text; returns the stop string if this token completed one (the text is cut there)."""
        if self.stop_str is not None:
            return self.stop_str
        piece = self._decoder.step(token_id)
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
        start = len(self.text)
        self.text += piece
        if self.stops:
            hit = find_stop(self.text, start, self.stops)
            if hit is not None:
                self.text = self.text[:hit[0]]
                self.stop_str = hit[1]
        return self.stop_str

    def finish(self) -> None:
        """The request ended: release what was held back for a clean-up pattern."""
        if not self.finished and self.stop_str is None and self._raw_tail:
            tail, self._raw_tail = self._raw_tail, ""
            self._append(_cleanup(tail))
        self.finished = True

    def take(self) -> str:
        """Text not handed out before that can be shown now: until the end, a tail that is the start of a stop
        string is held back."""
        end = len(self.text)
        if not self.finished and self.stops:
            end -= partial_stop_len(self.text, self.stops)
        if end <= self._sent:
            return ""
        out = self.text[self._sent:end]
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
