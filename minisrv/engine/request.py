"""A request's state machine, its sampling parameters, and what the engine reports back."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

SEED_RANGE = 2 ** 31  # seeds are kept within 31 bits so the on-device hash stays in int64 without overflow


@dataclass
class SamplingParams:
    """Per-request sampling settings, with vLLM/OpenAI meanings. temperature 0 is greedy."""

    max_tokens: Optional[int] = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: none; 0: the chosen token's; n: also the top n
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: Dict[int, float]  # token id -> logprob of the top-n (empty when n = 0)


_ids = itertools.count()


@dataclass
class Request:
    prompt_ids: List[int]
    params: SamplingParams
    max_new_tokens: int  # resolved against the context length at admission
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    eos_ids: Sequence[int] = ()
    arrival: int = field(default_factory=lambda: next(_ids))

    # engine state
    status: RequestStatus = RequestStatus.WAITING
    output_ids: List[int] = field(default_factory=list)
    logprobs: List[TokenLogprob] = field(default_factory=list)
    row: int = -1  # row in the request->token table while resident
    pages: List[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the pool
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_str: Optional[str] = None  # the stop string that ended it, if any
    sampling_seed: int = 0
    text: str = ""  # decoded so far; maintained only when stop strings must be checked
    _detok: Optional[object] = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:  # only seeded rows use it (see sampler)
            self.sampling_seed = self.params.seed % SEED_RANGE

    @property
    def all_ids(self) -> List[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def has_penalties(self) -> bool:
        return self.params.has_penalties


@dataclass
class RequestOutput:
    """One step's news about one request: the tokens it gained (usually one), and whether it ended."""

    rid: str
    new_token_ids: List[int]
    new_logprobs: List[TokenLogprob]
    finished: bool
    finish_reason: Optional[str] = None
    stop_str: Optional[str] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: Optional[str] = None


@dataclass
class CompletionOutput:
    """What the offline API returns per prompt."""

    prompt: Optional[str]
    prompt_token_ids: List[int]
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    logprobs: Optional[List[TokenLogprob]] = None
