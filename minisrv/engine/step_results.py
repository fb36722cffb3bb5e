"""A step's results on the host: each sampled token with its request, and how a token joins its request (its
output, its logprobs, its grammar and thinking state)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .request import Request, TokenLogprob


@dataclass
class SampledToken:
    """A token that reached the host, already appended to its request's output_ids and fed to its grammar, unless
    `appended` is False (token_id None: a request that only scores its prompt, max_tokens 0, reached the end of its
    prefill)."""

    req: Request
    token_id: Optional[int]
    logprob: Optional[TokenLogprob]
    grammar_ended: bool = False  # its grammar accepted a stop token: the request is complete
    error: Optional[Exception] = None  # its grammar rejected the token: the request fails
    appended: bool = True  # False: a verified token, appended (take_token) only if its request goes on


@dataclass
class StepHidden:
    """What an EAGLE-3 head reads of an extend or verify step (engine/speculative/eagle.py): the target layers'
    inputs [T, 3 x hidden] of its tokens; request i's rows start at the sum of lens[:i], at position starts[i]."""

    aux: torch.Tensor
    reqs: List[Request]
    starts: List[int]
    lens: List[int]


@dataclass
class CollectedStep:
    """A launched step's results on the host: its tokens, or the error that lost them (for all of `reqs`)."""

    reqs: List[Request]
    tokens: List[SampledToken]
    error: Optional[Exception] = None
    verified: List[Tuple[Request, int, int]] = field(default_factory=list)  # a verify step's (request, drafted, kept)
    hidden: Optional[StepHidden] = None


def token_logprob(req: Request, tok: int, row: int, lps: Optional[List[float]], top) -> Optional[TokenLogprob]:
    """The sampled token's logprob and the request's top-n, where it asked for them."""
    if lps is None or req.params.logprobs is None:
        return None
    n_top = req.params.logprobs
    tops = dict(zip(top[1][row][:n_top], top[0][row][:n_top])) if n_top > 0 and top is not None else {}
    return TokenLogprob(tok, lps[row], tops)


def take_token(s: SampledToken) -> SampledToken:
    """A token joins its request (output, logprobs), then its grammar (the next step's mask is made from the
    grammar's state); with a thinking model's rule, only the answer's tokens reach the grammar (engine/thinking.py)."""
    req = s.req
    req.output_ids.append(s.token_id)
    if s.logprob is not None:
        req.logprobs.append(s.logprob)
    answer = req.thinking is None or req.thinking.advance(s.token_id)
    if req.grammar is not None and answer:
        try:
            s.grammar_ended = req.grammar.advance(s.token_id)
        except Exception as e:  # noqa: BLE001 - fails this request alone
            s.error = e
    return s
