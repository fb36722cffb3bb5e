"""A request's state machine, its sampling parameters and their validation, and what the engine reports back.

Validation lives here once: `SamplingParams.validate` checks what needs no model (types, ranges, counts) when the
frozen params are built, and `check_request` what depends on the model (token ids in the vocabulary, the context
length). The offline `LLM`, the engine and the HTTP server all call these; a failure is a `RequestError` naming
the offending field.
"""
from __future__ import annotations

import enum
import itertools
import json
import math
import operator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Union

from .thinking import ThinkingRule, ThinkingState

if TYPE_CHECKING:
    from .text import TextStream

MAX_STOPS = 64  # stop strings, and stop token ids, per request
MAX_STOP_CHARS = 1024  # length of one stop string
MAX_LOGPROBS = 20  # top-n logprobs per token (OpenAI's limit)
MAX_LOGIT_BIAS = 1024  # tokens one request may bias


class RequestError(ValueError):
    """A request that cannot be served as asked; `param` names the field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ids_in_range(ids: Sequence[object], vocab: int) -> bool:
    """Whether every id is an int (not a bool) in [0, vocab). A prompt of plain ints, the usual case, is checked
    with C loops (the set of its element types, then min and max); anything else takes the test per token."""
    if set(map(type, ids)) == {int}:
        return min(ids) >= 0 and max(ids) < vocab
    return all(_is_int(t) and 0 <= t < vocab for t in ids)


def _is_number(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


# a SamplingParams field's type (float: any finite number; Optional: None passes too), its allowed values, and how a
# 400 says them
FIELD_RULES = {
    "max_tokens": (Optional[int], lambda v: v >= 0, "at least 0"),
    "temperature": (float, lambda v: v >= 0, "non-negative"),
    "top_p": (float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "top_k": (int, lambda v: v >= -1, "-1 (disabled) or positive"),
    "min_p": (float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "presence_penalty": (float, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "frequency_penalty": (float, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "repetition_penalty": (float, lambda v: 0.0 < v <= 100.0, "in (0, 100]"),
    "seed": (Optional[int], lambda v: -2 ** 63 <= v < 2 ** 63, "a signed 64-bit integer"),
    "logprobs": (Optional[int], lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
    "prompt_logprobs": (Optional[int], lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
}


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with vLLM/OpenAI meanings. temperature 0 is greedy.

    Built once with every field and frozen: the values are validated at construction (a RequestError naming the
    field), so whatever holds one holds checked values; a variant is `dataclasses.replace(params, ...)`, which
    validates its values anew. A copy that arrives pickled from another process is validated as it is loaded."""

    max_tokens: Optional[int] = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[None, str, Sequence[str]] = None  # kept as a tuple of strings
    stop_token_ids: Optional[Sequence[int]] = None  # kept as a tuple of ids
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: none; 0: the chosen token's; n: also the top n
    logit_bias: Optional[Dict[int, float]] = None  # token id -> added to its logit before sampling (OpenAI's)
    prompt_logprobs: Optional[int] = None  # the same for each prompt token (vLLM's name); the first is None
    skip_special_tokens: bool = True
    # structured outputs, at most one (SGLang/vLLM names); compiled and enforced by engine/grammar.py
    json_schema: Optional[str] = None  # a JSON schema as JSON text ("{}" or '{"type": "object"}': any JSON)
    json_object: bool = False  # any JSON object
    regex: Optional[str] = None
    ebnf: Optional[str] = None  # an EBNF grammar (xgrammar's, GBNF-like) whose start rule is named root
    # a thinking model's tags and budget (engine/thinking.py): a grammar then constrains only the answer
    thinking: Optional[ThinkingRule] = None

    def __post_init__(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    def with_seed(self, seed: int) -> "SamplingParams":
        """The same values with another seed (n > 1 choices of one request), without validating the rest again."""
        if not _is_int(seed) or not -2 ** 63 <= seed < 2 ** 63:
            raise RequestError(f"seed must be a signed 64-bit integer, got {seed}", "seed")
        twin = object.__new__(SamplingParams)
        twin.__dict__.update(self.__dict__, seed=seed)
        return twin

    def __setstate__(self, state: Dict[str, object]) -> None:
        """Unpickled (the engine process receives what the HTTP process built): validated here, once."""
        self.__dict__.update(state)
        self.validate()

    def validate(self) -> None:
        """Types, ranges and counts that need no model; raises RequestError."""
        for name, (kind, ok, allowed) in FIELD_RULES.items():
            v = getattr(self, name)
            if v is None and kind == Optional[int]:
                continue
            if not (_is_number(v) if kind is float else _is_int(v)):
                raise RequestError(f"{name} must be {'a finite number' if kind is float else 'an integer'}, got {v!r}",
                                   name)
            if not ok(v):
                raise RequestError(f"{name} must be {allowed}, got {v}", name)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise RequestError("max_tokens 0 generates nothing: it is only allowed to score the prompt "
                               "(with prompt logprobs, or echo with logprobs)", "max_tokens")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
            for t, v in self.logit_bias.items():
                if not _is_int(t) or not _is_number(v) or not -100.0 <= v <= 100.0:
                    raise RequestError("logit_bias maps token ids to biases in [-100, 100]", "logit_bias")
        if len(self.stop) > MAX_STOPS:
            raise RequestError(f"at most {MAX_STOPS} stop strings, got {len(self.stop)}", "stop")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"stop strings must be non-empty strings of at most {MAX_STOP_CHARS} characters", "stop")
        if len(self.stop_token_ids) > MAX_STOPS or not all(_is_int(t) for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be at most {MAX_STOPS} integers", "stop_token_ids")
        self._validate_constraint()
        if self.thinking is not None:
            why = self.thinking.problem() if isinstance(self.thinking, ThinkingRule) else "it is not a ThinkingRule"
            if why is not None:
                raise RequestError(f"thinking: {why}", "thinking_budget" if "budget" in why else "thinking")

    def _validate_constraint(self) -> None:
        """Structured outputs: types, at most one, and a schema that is JSON; the grammar itself is checked when
        compiled (engine/grammar.py)."""
        if not isinstance(self.json_object, bool):
            raise RequestError(f"json_object must be a boolean, got {self.json_object!r}", "json_object")
        for name in ("json_schema", "regex", "ebnf"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise RequestError(f"{name} must be a non-empty string", name)
        given = [n for n in ("json_schema", "json_object", "regex", "ebnf") if getattr(self, n) not in (None, False)]
        if len(given) > 1:
            raise RequestError(f"at most one of json_schema, json_object, regex and ebnf may be given, got "
                               f"{' and '.join(given)}", given[1])
        if self.json_schema is not None:
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                raise RequestError(f"json_schema is not valid JSON: {e}", "json_schema") from None

    @property
    def greedy(self) -> bool:
        """temperature 0, or top_p 0 (only the most likely token is left: OpenAI accepts it and means greedy)."""
        return self.temperature == 0.0 or self.top_p == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def prompt_logprob_list(req: "Request") -> Optional[List[Optional["TokenLogprob"]]]:
    """A request's prompt logprobs in prompt order (None: it asked for none); the first token has none (nothing
    predicts it)."""
    if req.params.prompt_logprobs is None:
        return None
    return [None] + [req.prompt_logprobs.get(i) for i in range(1, len(req.prompt_ids))]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: Dict[int, float]  # token id -> logprob of the top-n (empty when n = 0)


_request_ids = itertools.count()  # default request ids
_arrivals = itertools.count()  # arrival order, for the scheduler's first-come-first-served


@dataclass(eq=False)
class Request:
    """One request's state. Compared by identity: the scheduler finds requests in its queues (`list.remove`, `in`),
    and field-wise equality would compare whole prompts, which requests sharing a long prefix make slow."""

    prompt_ids: List[int]
    params: SamplingParams
    max_new_tokens: int  # resolved against the context length at admission
    rid: Optional[str] = None  # None: req-0, req-1, ... in order
    eos_ids: Sequence[int] = ()
    arrival: int = field(default_factory=lambda: next(_arrivals))
    text: Optional["TextStream"] = None  # the output's text, made by the engine as tokens arrive

    # engine state
    status: RequestStatus = RequestStatus.WAITING
    output_ids: List[int] = field(default_factory=list)  # sampled tokens whose values have reached the host
    num_pending: int = 0  # sampled tokens still on the device (overlap scheduling; see model_runner)
    logprobs: List[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: Dict[int, TokenLogprob] = field(default_factory=dict)  # prompt position -> its logprob
    row: int = -1  # row in the request->token table while resident
    pages: List[int] = field(default_factory=list)
    # a model whose windowed layers keep only their window: beside each page, the windowed page of the same positions
    # while it may still be read, None before `window_lo` (engine/scheduler/window.py)
    window_pages: List[Optional[int]] = field(default_factory=list)
    window_lo: int = 0
    num_cached: int = 0  # tokens whose K/V are in the pool
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    sampling_seed: int = 0  # the request's seed (signed 64-bit), for seeded sampling
    solo: bool = False  # in a step that failed: runs in batches of its own until it samples a token
    cache_node: Optional[object] = None  # the prefix-cache node it holds locked (kvcache.radix), if any
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at admission
    grammar: Optional[object] = None  # its structured-output state (engine/grammar.py GrammarState), if any
    embedding: Optional[object] = None  # an embedding request's pooling (engine/pooling.py EmbeddingState)
    thinking: Optional[ThinkingState] = None  # where its output is, with params.thinking (engine/thinking.py)

    def __post_init__(self) -> None:
        if self.rid is None:
            self.rid = f"req-{next(_request_ids)}"
        if self.params.seed is not None:  # only seeded rows use it (see sampler)
            self.sampling_seed = self.params.seed
        if self.params.thinking is not None:
            self.thinking = ThinkingState(self.params.thinking)

    @property
    def all_ids(self) -> List[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_id(self) -> int:
        """Its newest token on the host (the prompt's last before any output)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_output_tokens(self) -> int:
        """Sampled tokens, including those still on their way from the device."""
        return len(self.output_ids) + self.num_pending

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def needs_accepted_tokens(self) -> bool:
        """Whether its sampling needs its previous token accepted on the host: a grammar's mask, and a thinking
        budget's forced end, are made from the tokens so far."""
        return self.grammar is not None or (self.thinking is not None and self.params.thinking.budget is not None)


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against once the model is known."""

    vocab_size: int
    max_request_len: int  # prompt + output tokens (the context length, or less when the KV pool is smaller)


def check_request(prompt_ids: Sequence[int], params: SamplingParams, limits: RequestLimits,
                  prompt_param: str = "prompt") -> int:
    """Validate a request against the model; returns its output budget (max_new_tokens). Raises RequestError.
    `params` itself was validated when it was built (SamplingParams is frozen)."""
    vocab = limits.vocab_size
    if not prompt_ids:
        raise RequestError("the prompt is empty", prompt_param)
    if not _ids_in_range(prompt_ids, vocab):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab})", prompt_param)
    if any(t < 0 or t >= vocab for t in params.stop_token_ids):
        raise RequestError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
    if params.logit_bias and any(t < 0 or t >= vocab for t in params.logit_bias):
        raise RequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
    if params.thinking is not None and any(t >= vocab for t in params.thinking.ids()):
        raise RequestError(f"thinking token ids must be in [0, {vocab})", "thinking")
    if params.top_k > vocab:
        raise RequestError(f"top_k must be at most the vocabulary size {vocab} (or -1), got {params.top_k}", "top_k")
    limit = limits.max_request_len
    n = len(prompt_ids)
    if params.max_tokens is None:
        if n >= limit:
            raise RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                               f"{n} tokens, which leaves no room for a completion.", prompt_param,
                               "context_length_exceeded")
        return limit - n
    if n + params.max_tokens > limit:
        raise RequestError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the "
                           f"completion). Please reduce the prompt or max_tokens.", "max_tokens",
                           "context_length_exceeded")
    return params.max_tokens


@dataclass
class RequestOutput:
    """One step's news about one request: the tokens it gained (usually one), their text, and whether it ended."""

    rid: str
    new_token_ids: List[int]
    new_text: str  # text that can be shown now (a tail that may become a stop string is held back until known)
    new_logprobs: List[TokenLogprob]
    text_offsets: List[int]  # per new token: where its text starts in the whole output text
    finished: bool
    finish_reason: Optional[str] = None
    stop_str: Optional[str] = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: Optional[str] = None  # with finish_reason "error": what went wrong
    # ... and, when the request itself is at fault (a grammar that does not compile), the field to blame: the
    # server answers a 400 naming it, not an engine failure
    error_param: Optional[str] = None
    prompt_logprobs: Optional[List[Optional[TokenLogprob]]] = None  # with the first output, when asked for
    embedding: Optional[object] = None  # an embedding request's vector (float32 numpy array), when it ends

    def __reduce__(self) -> tuple:
        """Pickled as its fields in order, for the constructor: a server's engine sends one a running request a step,
        and this loads several times faster than a dataclass's state dict."""
        return RequestOutput, _output_fields(self)

    @classmethod
    def ended(cls, req: Request, reason: str, *, error: Optional[str] = None, error_param: Optional[str] = None,
              num_cached_tokens: int = 0, prompt_logprobs: Optional[List[Optional[TokenLogprob]]] = None,
              embedding: Optional[object] = None) -> "RequestOutput":
        """A request that ends without a new token: aborted, failed, done scoring its prompt, or embedded."""
        return cls(rid=req.rid, new_token_ids=[], new_text="", new_logprobs=[], text_offsets=[], finished=True,
                   finish_reason=reason, num_output_tokens=len(req.output_ids), num_cached_tokens=num_cached_tokens,
                   error=error, error_param=error_param, prompt_logprobs=prompt_logprobs, embedding=embedding)

    @classmethod
    def token(cls, req: Request, token_id: int, text: str, logprob: Optional[TokenLogprob], offset: int,
              reason: Optional[str], prompt_logprobs: Optional[List[Optional[TokenLogprob]]] = None
              ) -> "RequestOutput":
        """A request's newest token and the text it makes showable; `reason` when it ended the request."""
        return cls(rid=req.rid, new_token_ids=[token_id], new_text=text,
                   new_logprobs=[logprob] if logprob is not None else [], text_offsets=[offset],
                   finished=reason is not None, finish_reason=reason, stop_str=req.text.stop_str,
                   num_output_tokens=len(req.output_ids), num_cached_tokens=req.num_cached_tokens,
                   prompt_logprobs=prompt_logprobs)


_output_fields = operator.attrgetter(*(f.name for f in fields(RequestOutput)))


@dataclass
class CompletionOutput:
    """What the offline API returns per prompt."""

    prompt: Optional[str]
    prompt_token_ids: List[int]
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    logprobs: Optional[List[TokenLogprob]] = None
    prompt_logprobs: Optional[List[Optional[TokenLogprob]]] = None  # one per prompt token, the first None
