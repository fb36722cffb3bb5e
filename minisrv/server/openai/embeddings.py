"""POST /v1/embeddings, OpenAI's shape, on an embedding model (engine/pooling.py).

A server is either an embedding or a generation server (EngineInfo.embedding_dim): asking one for what only the
other serves is a 400 naming the endpoint to use. Each input is tokenized (with the special tokens, as
sentence-transformers does) and checked with the engine's own check, so a bad input is a 400 before anything is
queued; the inputs are then submitted at once (their prefills batch) and travel generation.run_jobs, the
generation endpoints' path. `encoding_format` "base64" is the base64 of little-endian float32 bytes, as OpenAI's."""
from __future__ import annotations

import base64
import uuid
from typing import Any, List, Literal, Optional, Union

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, field_validator

from minisrv.engine.pooling import PoolingParams, check_embedding_input

from ..http.json_body import parse_body
from ..errors import APIError
from ..generation import Job, run_jobs
from ..plan.prompt import ASYNC_ENCODE_CHARS, off_loop
from ..state import ServerState
from ..streaming import unless_disconnected
from .protocol import token_inputs

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)


class EmbeddingRequest(BaseModel):
    input: Any  # str | list[str] | list[int] | list[list[int]], checked below
    model: Optional[str] = None
    dimensions: Optional[int] = None
    encoding_format: Literal["float", "base64"] = "float"
    user: Optional[str] = None

    @field_validator("input")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        if v == "" or v == [] or (isinstance(v, list) and any(x == "" or x == [] for x in v)):
            raise ValueError("input must not be empty, nor hold an empty string or an empty token list")
        return token_inputs(v, "input")


async def embeddings(state: ServerState, request: Request) -> Response:
    body, large = await parse_body(request, EmbeddingRequest)
    state.check_model(body.model)
    info = state.info
    params = PoolingParams(body.dimensions)
    raw = body.input
    if len(raw) > MAX_INPUTS:
        raise APIError(400, f"a request may embed at most {MAX_INPUTS} inputs, got {len(raw)}", param="input")
    if not info.embedding_dim:
        raise APIError(400, "this model generates text and serves no embeddings: /v1/embeddings needs an embedding "
                            "model (one with sentence-transformers pooling files or no LM head, or one served with "
                            "--is-embedding)", param="model", code="model_not_embedding")

    def prepare() -> List[List[int]]:
        inputs = []
        for x in raw:
            ids = state.prompts.encode(x, True, "input", info.max_request_len) if isinstance(x, str) else list(x)
            check_embedding_input(ids, info.embedding_dim, params, info.limits)
            inputs.append(ids)
        return inputs

    size = sum(len(x) for x in raw)  # characters or token ids
    inputs = await off_loop(large or size > ASYNC_ENCODE_CHARS, prepare)
    rid = f"embd-{uuid.uuid4().hex}"
    jobs = [Job(i, f"{rid}-{i}", ids, params) for i, ids in enumerate(inputs)]
    vectors: List[Optional[np.ndarray]] = [None] * len(jobs)

    async def collect() -> None:
        async for step in run_jobs(state, jobs):
            for index, out in step:
                if out.finished:
                    vectors[index] = out.embedding

    await unless_disconnected(request, collect())
    n = sum(len(ids) for ids in inputs)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": state.served_model_name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


def _encoded(v: np.ndarray, encoding_format: str) -> Union[List[float], str]:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(v, dtype=np.float32).tolist()
