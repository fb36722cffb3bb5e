"""The HTTP app: each room's routes (openai/, responses/, anthropic/) on one FastAPI app, behind the gate (gate.py),
with every error in its API's shape (errors.py). The chat-shaped APIs share the request plan (plan/) and every
generation takes one path to the engine and back (generation.py)."""
from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .anthropic import routes as anthropic
from .errors import engine_unavailable, install_error_handlers
from .http.gate import Gate
from .openai import routes as openai
from .openai import tokenizer
from .openai.embeddings import embeddings
from .replicas import Replicas
from .responses.routes import respond
from .state import ServerState

# each room's routes: (method, paths, handler(state, request))
ROUTES = [("POST", ("/v1/completions",), openai.completions), ("POST", ("/v1/chat/completions",), openai.chat),
          ("POST", ("/v1/embeddings",), embeddings), ("POST", ("/v1/responses",), respond),
          ("POST", ("/v1/messages",), anthropic.messages),
          ("POST", ("/v1/messages/count_tokens",), anthropic.count_tokens),
          ("POST", ("/tokenize", "/v1/tokenize"), tokenizer.tokenize),
          ("POST", ("/detokenize", "/v1/detokenize"), tokenizer.detokenize),
          ("GET", ("/tokenizer_info",), tokenizer.tokenizer_info),
          ("GET", ("/get_model_info", "/model_info"), tokenizer.get_model_info),
          ("GET", ("/server_info", "/get_server_info"), tokenizer.server_info),
          ("POST", ("/flush_cache",), tokenizer.flush_cache)]


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="minisrv", version="0.1.0", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(Gate, state=state, engine_paths={path for _, paths, _ in ROUTES for path in paths})

    @app.get("/health")
    async def health() -> Response:
        if not state.ready:
            return engine_unavailable().response()
        return JSONResponse(state.client.health() if isinstance(state.client, Replicas) else {"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.set_engine_stats(await state.client.fresh_stats())
        if isinstance(state.client, Replicas):
            state.metrics.set_replicas(state.client.report())
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [state.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        state.check_model(model)
        return JSONResponse(state.model_card())

    for method, paths, handler in ROUTES:
        for path in paths:
            app.add_api_route(path, _endpoint(state, handler), methods=[method], name=handler.__name__)
    return app


def _endpoint(state: ServerState, handler: Callable[[ServerState, Request], Awaitable[Response]]) -> Callable:
    async def endpoint(request: Request) -> Response:
        return await handler(state, request)
    return endpoint
