"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API, planned as chat is (plan/chat.py)
and served by generation.serve; only its conversion (protocol.py) and shapes (render.py) are its own. count_tokens
answers `{"input_tokens": N}`, the length of the prompt the same request would be planned into."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..http.json_body import parse_body
from ..generation import Generation, serve
from ..plan.chat import plan_chat
from ..state import ServerState
from .protocol import CountTokensRequest, MessagesRequest, chat_inputs
from .render import MessageRenderer


async def count_tokens(state: ServerState, request: Request) -> Response:
    body, large = await parse_body(request, CountTokensRequest)
    state.check_generation_model(body.model)
    plan = await plan_chat(state.prompts, chat_inputs(body, state.prompts.reasoning is not None), state.info.limits,
                           large)
    return JSONResponse({"input_tokens": len(plan.prompt_ids)})


async def messages(state: ServerState, request: Request) -> Response:
    body, large = await parse_body(request, MessagesRequest)
    state.check_generation_model(body.model)
    sampling = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k") if getattr(body, k) is not None}
    sampling.update(max_tokens=body.max_tokens, stop=body.stop_sequences or None)
    inputs = chat_inputs(body, state.prompts.reasoning is not None, sampling)
    plan = await plan_chat(state.prompts, inputs, state.info.limits, large)
    renderer = MessageRenderer(state.served_model_name, len(plan.prompt_ids), plan.tools, plan.reasoning)
    return await serve(state, request, Generation([plan.prompt_ids], plan.params), renderer, bool(body.stream))
