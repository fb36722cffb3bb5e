"""Routes beside the OpenAI API: the tokenizer (vLLM's shapes; /tokenizer_info is what lm-evaluation-harness's
RemoteTokenizer reads), the model's description and the prefix cache (SGLang's names).

/tokenize's chat form is planned exactly as a chat request's messages and tools are (plan/chat.py), so its count is
the prompt length a chat request would have; a text longer than max_model_len is tokenized all the same (lm-eval
truncates long contexts itself). /flush_cache is POST only: a GET that changes state could be sent by any web page
(an image's URL carries no Origin), and like every POST it must be application/json."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, StrictBool, StrictInt, StrictStr, model_validator

from minisrv import __version__

from ..http.json_body import parse_body
from ..engine_proc import EngineDead
from ..errors import APIError, engine_unavailable
from ..plan.chat import ChatInputs, plan_chat
from ..plan.prompt import ASYNC_ENCODE_CHARS, off_loop
from ..plan.reasoning import chat_template_text
from .protocol import ChatMessage
from .routes import chat_messages

if TYPE_CHECKING:
    from ..state import ServerState

INLINE_DECODE_TOKENS = 4096  # longer token lists are checked and decoded in a worker thread


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) in one schema: exactly one
    of the two. add_special_tokens defaults to true for a prompt and to false for messages (the template writes
    the special tokens itself)."""

    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False
    tools: Optional[List[Any]] = None  # function tools, as chat's (they reach the prompt as chat's do)
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # as chat's ({"enable_thinking": false}): the same prompt

    @model_validator(mode="after")
    def _one_form(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either `prompt` (a string) or `messages` (a chat), not both or neither")
        if self.messages is not None:
            if not self.messages:
                raise ValueError("messages must not be empty")
            if self.add_generation_prompt and self.continue_final_message:
                raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self


class DetokenizeRequest(BaseModel):
    model: Optional[StrictStr] = None
    tokens: List[StrictInt]


class FlushCacheRequest(BaseModel):
    """/flush_cache takes no parameters; a body, if sent, must be a JSON object."""


def tokenizer_path(state: "ServerState") -> str:
    """Where the tokenizer was loaded from: --tokenizer, else the model path (a GGUF file's own vocabulary)."""
    cfg = getattr(state.client, "cfg", None)
    return getattr(cfg, "tokenizer", None) or state.info.model_path


def _answer(state: "ServerState", ids: List[int], token_strs: bool) -> JSONResponse:
    out: Dict[str, Any] = {"count": len(ids), "max_model_len": state.info.max_request_len, "tokens": ids}
    if token_strs:
        out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(out)


async def tokenize(state: "ServerState", request: Request) -> JSONResponse:
    body, large = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    if body.messages is not None:
        inputs = ChatInputs(chat_messages(body.messages), body.tools, template_kwargs=body.chat_template_kwargs,
                            add_generation_prompt=body.add_generation_prompt,
                            continue_final_message=body.continue_final_message,
                            add_special_tokens=bool(body.add_special_tokens))
        plan = await plan_chat(state.prompts, inputs, None, large)
        return _answer(state, plan.prompt_ids, body.return_token_strs)
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    return await off_loop(large or len(body.prompt) > ASYNC_ENCODE_CHARS, lambda: _answer(
        state, state.tokenizer(body.prompt, add_special_tokens=add_special).input_ids, body.return_token_strs))


async def detokenize(state: "ServerState", request: Request) -> JSONResponse:
    body, large = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    tok, ids = state.tokenizer, body.tokens

    def decode() -> str:
        size = len(tok)
        for i, t in enumerate(ids):
            if not 0 <= t < size:
                raise APIError(400, f"tokens[{i}] = {t} is not in the tokenizer's vocabulary (ids 0 to {size - 1})",
                               param="tokens", code="invalid_token_id")
        return tok.decode(ids)

    return JSONResponse({"prompt": await off_loop(large or len(ids) > INLINE_DECODE_TOKENS, decode)})


async def tokenizer_info(state: "ServerState", request: Request) -> JSONResponse:
    tok = state.tokenizer
    return JSONResponse({
        "tokenizer_class": type(tok).__name__, "tokenizer_path": tokenizer_path(state),
        "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id, "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id, "pad_token": tok.pad_token, "pad_token_id": tok.pad_token_id,
        "unk_token": tok.unk_token, "chat_template": chat_template_text(tok),
        # the enforced limit, as max_model_len elsewhere (HF's own value is often a 1e30 placeholder)
        "model_max_length": state.info.max_request_len, "vocab_size": len(tok)})


async def get_model_info(state: "ServerState", request: Request) -> JSONResponse:
    info = state.info
    return JSONResponse({
        "model_path": info.model_path, "served_model_name": state.served_model_name,
        "tokenizer_path": tokenizer_path(state), "is_generation": True, "max_model_len": info.max_request_len,
        "context_length": info.context_length, "vocab_size": info.vocab_size})


async def server_info(state: "ServerState", request: Request) -> JSONResponse:
    """SGLang's /server_info, the part that applies: a router in front (sglang-router) names the worker's model by
    served_model_name."""
    return JSONResponse({"served_model_name": state.served_model_name, "model_path": state.info.model_path,
                         "tokenizer_path": tokenizer_path(state), "version": __version__})


async def flush_cache(state: "ServerState", request: Request) -> JSONResponse:
    if await request.body():
        await parse_body(request, FlushCacheRequest)
    try:
        flushed = await state.client.flush_cache()
    except EngineDead as e:
        raise engine_unavailable(str(e)) from None
    if not flushed:
        raise APIError(400, "Cache not flushed because there are pending requests", code="requests_pending")
    return JSONResponse({"flushed": True})
