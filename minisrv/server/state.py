"""What the HTTP routes share: the engine replicas, the tokenizer, the model's limits, the policy and metrics, and the
server's stop (tokenizer and info are None while the engine loads)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Set

from minisrv import __version__

from .errors import APIError
from .http.policy import HTTPPolicy
from .messages import EngineInfo
from .metrics import ServerMetrics
from .openai.logprobs import TokenText
from .openai.protocol import now
from .plan.prompt import PromptMaker
from .replicas import Replicas


@dataclass
class ServerState:
    client: Replicas
    served_model_name: str
    tokenizer: Any = None
    info: Optional[EngineInfo] = None
    model_aliases: Sequence[str] = ()
    api_key: Optional[str] = None
    http: HTTPPolicy = field(default_factory=HTTPPolicy)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=now)
    token_text: Optional[TokenText] = None
    tool_call_parser: str = "auto"  # hermes | llama3_json | auto (from the chat template); see plan/tools.py
    reasoning_parser: Optional[str] = None  # qwen3 | deepseek_r1 | auto | None (plan/reasoning.py)
    prompts: Optional[PromptMaker] = None  # the request plan's view of the tokenizer, made by use_tokenizer
    stopping: bool = False  # the shutdown's grace period is over: what still runs is ended (see stop)
    on_stop: Set[Callable[[], None]] = field(default_factory=set)  # what stop() tells

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.info is not None:
            self.attach(self.tokenizer, self.info)

    def attach(self, tokenizer: Any, info: EngineInfo) -> None:
        """The engine is up: from now on requests are served."""
        if self.prompts is None or self.prompts.tokenizer is not tokenizer:
            self.use_tokenizer(tokenizer)
        self.info = info

    def use_tokenizer(self, tokenizer: Any) -> None:
        """What the routes derive from the tokenizer; the server calls it while the engine still loads (the longest
        token's length alone is a pass over the vocabulary)."""
        # ValueError: a reasoning parser this tokenizer cannot serve
        self.prompts = PromptMaker.of(tokenizer, self.tool_call_parser, self.reasoning_parser)
        self.tokenizer = tokenizer
        self.token_text = TokenText(tokenizer)

    @property
    def fingerprint(self) -> str:
        """OpenAI's system_fingerprint: what, besides the weights, decides the outputs here."""
        return f"fp_minisrv_{__version__}_{self.info.backend_name.replace(',', '_')}"

    def stop(self) -> None:
        """End every request still running: generations end with a server_shutdown error (a 503, or a stream's
        error event and [DONE]), body reads with a 503; new ones are answered so at once."""
        self.stopping = True
        for tell in list(self.on_stop):
            tell()

    @property
    def ready(self) -> bool:
        return self.info is not None and self.client.ready and not self.client.dead

    def check_model(self, name: Optional[str]) -> None:
        if name is None or name == self.served_model_name or name in self.model_aliases:
            return
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.served_model_name}`.",
                       param="model", code="model_not_found")

    def check_generation_model(self, name: Optional[str]) -> None:
        """check_model, and a 400 naming the endpoint it serves where this is an embedding model."""
        self.check_model(name)
        if self.info.embedding_dim:
            raise APIError(400, "this model is an embedding model: it serves /v1/embeddings, not completions or chat",
                           param="model", code="model_is_embedding")

    def model_card(self) -> Dict[str, Any]:
        # max_model_len: the limit requests are held to, the context length or less when the KV pool is smaller
        return {"id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "minisrv",
                "root": self.info.model_path, "max_model_len": self.info.max_request_len}
