"""Logprobs in OpenAI's two shapes (/v1/completions', /v1/chat/completions'). A logprob names its token by the
token's own text, which is not a piece of the output text (a byte-level BPE token can be half of a UTF-8 character),
so `TokenText` makes it from the vocabulary entry (display string and raw bytes), not by decoding."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from transformers.convert_slow_tokenizer import bytes_to_unicode

from minisrv.engine.request import TokenLogprob

PositionedLogprob = Tuple[TokenLogprob, int]  # a token's logprobs, with the offset of its text in the choice's text


class TokenText:
    """Token id -> (display string, raw bytes) for logprobs, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.cache: Dict[int, Tuple[str, List[int]]] = {}
        pieces = tokenizer.convert_ids_to_tokens(tokenizer(" a", add_special_tokens=False).input_ids)
        self.byte_level = bool(pieces) and pieces[0].startswith("Ġ")
        # the inverse of the GPT-2 byte-level alphabet (each byte 0..255 shown as one printable character)
        self.decoder = {c: b for b, c in bytes_to_unicode().items()} if self.byte_level else {}

    def get(self, tid: int) -> Tuple[str, List[int]]:
        hit = self.cache.get(tid)
        if hit is not None:
            return hit
        piece = self.tok.convert_ids_to_tokens(tid)
        raw: Optional[bytes] = None
        if isinstance(piece, str):
            if self.byte_level and all(c in self.decoder for c in piece):
                raw = bytes(self.decoder[c] for c in piece)
            elif not self.byte_level:
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    raw = bytes([int(piece[3:5], 16)])
                else:
                    raw = piece.replace("▁", " ").encode("utf-8")
        if raw is None:
            raw = self.tok.decode([tid]).encode("utf-8")
        hit = (raw.decode("utf-8", errors="replace"), list(raw))
        self.cache[tid] = hit
        return hit

    def string(self, tid: int) -> str:
        return self.get(tid)[0]


def completion_logprobs(tt: TokenText, tokens: Sequence[Tuple[int, Optional[TokenLogprob], int]],
                        top_n: int) -> Dict[str, List[Any]]:
    """(token id, its logprobs or None, its text's offset) per token; None (an echoed prompt's first token) is null,
    as OpenAI and vLLM answer."""
    out: Dict[str, List[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, offset in tokens:
        s = tt.string(tid)
        top = None
        if lp is not None:
            top = {tt.string(t): float(v) for t, v in list(lp.top.items())[:top_n]}
            top.setdefault(s, float(lp.logprob))  # OpenAI: the sampled token is always included
        out["tokens"].append(s)
        out["token_logprobs"].append(None if lp is None else float(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
    return out


def chat_logprobs(tt: TokenText, lps: Sequence[PositionedLogprob], top_n: int) -> Dict[str, Any]:
    def entry(tid: int, logprob: float) -> Dict[str, Any]:
        s, b = tt.get(tid)
        return {"token": s, "logprob": float(logprob), "bytes": b}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [
        entry(t, v) for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]]} for lp, _ in lps]}
