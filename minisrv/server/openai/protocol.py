"""OpenAI request/response schemas (the subset minisrv serves). pydantic checks a request's shape and types and the
fields only the server knows (n, the logprobs counts, the messages); the sampling fields' ranges are
SamplingParams' and check_request's, the one validation the offline API and the engine also use. Unknown fields are
ignored (pydantic's default, which every API's request schema keeps), as OpenAI-compatible servers do; unsupported
ones that would change a request's meaning are refused by the routes."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from minisrv.engine.request import MAX_LOGPROBS

MAX_N = 128  # choices per prompt
MAX_CHOICES = 256  # choices per request, all prompts together (prompts x n): bounds the work one request asks for


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None means: SamplingParams' default (for chat's
    max_tokens: the rest of the context)."""

    model: Optional[str] = None  # OpenAI requires it; minisrv serves one model and accepts its absence
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # -1 or 0: off
    min_p: Optional[float] = None
    n: Optional[int] = Field(None, ge=1, le=MAX_N)  # None: 1
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[Dict[str, float]] = None  # token id (as a string, OpenAI's shape) -> bias in [-100, 100]
    response_format: Optional[Dict[str, Any]] = None  # text | json_object | json_schema
    regex: Optional[str] = None  # SGLang's extra constraints
    ebnf: Optional[str] = None
    guided_choice: Optional[List[Any]] = None  # the answer is one of these strings (vLLM's name)
    choices: Optional[List[Any]] = None  # the same (the name SGLang's frontend language gives it)
    structured_outputs: Optional[Dict[str, Any]] = None  # vLLM's current form: choice, regex, json, grammar
    best_of: Optional[int] = None  # accepted only so that best_of != n gets a clear "not supported"


class CompletionRequest(_SamplingFields):
    prompt: Any = Field(...)  # str | list[str] | list[int] | list[list[int]], checked below
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Optional[bool] = False
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        return token_inputs(v, "prompt")


def token_inputs(v: Any, what: str) -> List[Union[str, List[int]]]:
    """Prompts (or an embedding's inputs) in any of their forms, as a list of strings or token-id lists."""
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(v, str) or (isinstance(v, list) and v and is_ids(v)):
        return [v]
    if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or all(is_ids(p) for p in v)):
        return v
    if isinstance(v, list) and not v:
        raise ValueError(f"{what} must not be empty")
    raise ValueError(f"{what} must be a string, a list of strings, a list of token ids or a list of token-id lists")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... are passed on to the chat template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = None


class ChatCompletionRequest(_SamplingFields):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name for max_tokens; wins over it
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[List[Any]] = None  # checked by server/plan/tools.py
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[List[Any]] = None  # the legacy form of tools / tool_choice, mapped onto them
    function_call: Optional[Any] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # extra template variables ({"enable_thinking": false})
    # thinking models (server/plan/reasoning.py): the thinking apart from content, and its budget in tokens
    separate_reasoning: StrictBool = True
    thinking_budget: Optional[StrictInt] = None
    custom_params: Optional[Dict[str, Any]] = None  # SGLang's; only its thinking_budget is read
    reasoning_effort: Optional[str] = None  # low | medium | high: the harmony format's (gpt-oss); else ignored


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class Envelope(BaseModel):
    """A whole /v1/completions or /v1/chat/completions answer, or one of its stream's chunks, around its choices
    (`object`: text_completion, chat.completion or chat.completion.chunk; a choice is a dict: render.py)."""

    id: str
    object: str
    created: int = Field(default_factory=now)
    model: str
    choices: List[Any]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


def chat_message(role: Optional[str], content: Optional[str] = None,
                 tool_calls: Optional[List[Dict[str, Any]]] = None, **extras: Any) -> Dict[str, Any]:
    """A chat answer's message, or a stream's delta (role None). `extras`: a thinking model's reasoning, under SGLang's
    and vLLM's name (reasoning_content) and under vLLM's newer one (reasoning), or a legacy `functions` request's
    function_call; these keys are left out where there is none, so that other responses keep their shape."""
    return {"role": role, "content": content, "tool_calls": tool_calls,
            **{k: v for k, v in extras.items() if v is not None}}
