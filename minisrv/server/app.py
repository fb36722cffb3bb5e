"""The HTTP app: each room's routes (openai/, responses/, anthropic/) on one FastAPI app, behind the gate (gate.py),
with every error in its API's shape (errors.py). The chat-shaped APIs share the request plan (plan/) and every
generation takes one path to the engine and back (generation.py)."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from .anthropic.routes import add_anthropic_routes
from .errors import ENGINE_UNAVAILABLE, SERVER, error_response, install_error_handlers
from .http.gate import Gate
from .openai.embeddings import add_embedding_routes
from .openai.protocol import ModelCard, ModelList
from .openai.routes import add_openai_routes
from .openai.tokenizer import add_tokenizer_routes
from .responses.routes import add_responses_routes
from .state import ServerState


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="minisrv", version="0.1.0", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(Gate, state=state)

    @app.get("/health")
    async def health() -> Response:
        if state.ready:
            return JSONResponse({"status": "ok"})
        return error_response(503, "the engine is not ready", SERVER, code=ENGINE_UNAVAILABLE)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.set_engine_stats(await state.client.fresh_stats())
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[state.model_card()])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        state.check_model(model)
        return state.model_card()

    add_openai_routes(app, state)
    add_tokenizer_routes(app, state)
    add_embedding_routes(app, state)
    add_anthropic_routes(app, state)
    add_responses_routes(app, state)
    return app
