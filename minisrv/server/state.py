"""What the HTTP routes share: the engine client, the tokenizer, the model's limits, the policy and metrics, and the
server's stop. tokenizer and info are None while the engine loads (every /v1 route is then a 503)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Set

from minisrv import __version__

from .engine_proc import EngineClient
from .errors import APIError
from .http.policy import HTTPPolicy
from .logprobs import TokenText
from .messages import EngineInfo
from .metrics import ServerMetrics
from .protocol import ModelCard, now
from .reasoning_plan import ReasoningFormat, resolve_reasoning
from .tool_prompt import template_reads_tools

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the routes share."""

    client: EngineClient
    served_model_name: str
    tokenizer: Any = None
    info: Optional[EngineInfo] = None
    model_aliases: Sequence[str] = ()
    api_key: Optional[str] = None
    http: HTTPPolicy = field(default_factory=HTTPPolicy)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=now)
    token_text: Optional[TokenText] = None
    max_token_chars: Optional[int] = None  # see max_token_chars(); None: unknown, no early length check
    tool_call_parser: str = "auto"  # hermes | llama3_json | auto (from the chat template); see tools.py
    reasoning_parser: Optional[str] = None  # qwen3 | deepseek_r1 | auto | None; resolved by attach (reasoning_plan.py)
    reasoning: Optional[ReasoningFormat] = None
    tools_in_template: bool = True  # False: the chat template ignores tools; they go in a system prompt (tool_prompt.py)
    stopping: bool = False  # the shutdown's grace period is over: what still runs is ended (see stop)
    on_stop: Set[Callable[[], None]] = field(default_factory=set)  # what stop() tells
    prepared_for: Any = None  # the tokenizer use_tokenizer last derived the fields above from

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.info is not None:
            self.attach(self.tokenizer, self.info)

    def attach(self, tokenizer: Any, info: EngineInfo) -> None:
        """The engine is up: from now on requests are served."""
        if self.prepared_for is not tokenizer:
            self.use_tokenizer(tokenizer)
        self.info = info

    def use_tokenizer(self, tokenizer: Any) -> None:
        """What the routes derive from the tokenizer; the server calls it while the engine still loads (the longest
        token's length alone is a pass over the vocabulary)."""
        self.reasoning = resolve_reasoning(self.reasoning_parser, tokenizer)  # ValueError: it cannot serve this one
        self.tokenizer, self.prepared_for = tokenizer, tokenizer
        self.token_text = TokenText(tokenizer)
        self.max_token_chars = max_token_chars(tokenizer)
        self.tools_in_template = template_reads_tools(tokenizer)
        logger.info("tools reach the model %s", "through its chat template" if self.tools_in_template else
                    "in a system prompt (its chat template ignores them)")

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

    def model_card(self) -> ModelCard:
        # the limit requests are held to: the context length, or less when the KV pool is smaller
        return ModelCard(id=self.served_model_name, created=self.created, root=self.info.model_path,
                         max_model_len=self.info.max_request_len)


def max_token_chars(tokenizer: Any) -> Optional[int]:
    """The most characters of input text one token can stand for, where the tokenizer makes that provable; None
    otherwise. Then a text of c characters is at least ceil(c / max_token_chars) tokens.

    Provable for a byte-level BPE without a normalizer (GPT-2, Llama 3, SmolLM2, ...): the text's UTF-8 bytes are
    split into pieces that keep every byte (ByteLevel, Split and Digits pre-tokenizers, unless a Split removes its
    matches), each token is one vocabulary entry whose string has one character per byte, and an added token
    matches its literal content; every character starts in exactly one token and has at least one byte, so a
    token covers at most as many characters as it has bytes. A fixed ratio would not do: SmolLM2 has a token
    of a newline and 80 spaces (81 characters). A normalizer (NFC, stripping, ...) can shrink the text, so with one there is no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
            return None
        if not any(p.get("type") == "ByteLevel" for p in parts):
            return None
        if any(p.get("type") not in ("ByteLevel", "Split", "Digits") or p.get("behavior") == "Removed"
               for p in parts):
            return None
        vocab = backend.get_vocab(with_added_tokens=False)
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        return max([len(s) for s in vocab] + [len(a.encode("utf-8")) for a in added])
    except Exception:  # noqa: BLE001 - an unexpected tokenizer: no early check, tokenizing still works
        return None
