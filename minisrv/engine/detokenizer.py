"""Incremental detokenization that never emits half a UTF-8 character, and stop-string matching."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

PROMPT_CONTEXT = 5  # prompt tokens decoded alongside the output, so word-initial spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: List[int] = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ('' while a character is still partial)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end), at finish."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


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
