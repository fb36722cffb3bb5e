"""Whether a checkpoint is an embedding model, and how its hidden states become one vector (the last token's or the
mean; normalised or not).

Read from the files, never guessed: a sentence-transformers directory lists a `Pooling` module in `modules.json`
(its config.json names the mode; a `Normalize` module means unit length). A bare decoder's architecture
(`Qwen3Model`, `LlamaModel`, ...: no LM head) can only be an embedding model; without sentence-transformers files it
gets Qwen3-Embedding's recipe (last token, normalised), and the log says so. `--is-embedding` makes any decoder one."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from minisrv.models.args import ModelArgs
from .checkpoint import WeightLoadError

logger = logging.getLogger("minisrv")

ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# the sentence-transformers pooling flags this server can honour, and the mode each one means
ST_MODE_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class PoolingConfig:
    """An embedding model's pooling: `mode` "last" (the last token's hidden state) or "mean" (the mean over every
    token), then normalised to unit length when `normalize`; `source` says where this was read (for the log)."""

    mode: str
    normalize: bool
    dim: int  # the vector's length: the model's hidden size
    source: str

    def describe(self) -> str:
        return (f"{'last-token' if self.mode == 'last' else 'mean'} pooling, "
                f"{'normalised' if self.normalize else 'not normalised'}, {self.dim} dimensions ({self.source})")


def resolve_pooling(path: str, args: ModelArgs, is_embedding: bool) -> Optional[PoolingConfig]:
    """The model's pooling if it is an embedding model (sentence-transformers files, a bare decoder's
    architecture, or `is_embedding`), else None: a generation model. Unsupported pooling is a WeightLoadError."""
    st = _sentence_transformers(path, args.hidden_size)
    if st is not None:
        return st
    if args.base_model or is_embedding:
        why = "a bare decoder's architecture" if args.base_model else "--is-embedding"
        return PoolingConfig("last", True, args.hidden_size,
                             f"Qwen3-Embedding's defaults: {why}, no sentence-transformers pooling config")
    return None


def _read_json(file: str) -> Any:
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise WeightLoadError(f"{file} cannot be read: {e}") from None


def _sentence_transformers(path: str, dim: int) -> Optional[PoolingConfig]:
    """The pooling a sentence-transformers directory's modules.json and its Pooling module's config.json say; None
    when the directory has no modules.json listing a Pooling module."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isdir(path) or not os.path.isfile(modules_file):
        return None
    modules: List[Dict[str, Any]] = _read_json(modules_file)
    if not isinstance(modules, list):
        raise WeightLoadError(f"{modules_file}: expected a list of modules")
    kinds = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    pooling = [m for m in modules if isinstance(m, dict) and m.get("type") == ST_POOLING]
    if not pooling:
        return None
    other = [k for k in kinds if k not in (ST_POOLING, ST_NORMALIZE, ST_TRANSFORMER)]
    if other:
        raise WeightLoadError(f"{modules_file}: sentence-transformers module(s) {', '.join(other)} are not "
                              f"supported (only Transformer, Pooling and Normalize)")
    sub = pooling[0].get("path") or "1_Pooling"
    cfg_file = os.path.join(path, sub, "config.json")
    cfg = _read_json(cfg_file) if os.path.isfile(cfg_file) else {}
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if not on and cfg.get("pooling_mode") is not None:  # newer sentence-transformers write the mode by name
        on = {"lasttoken": ["pooling_mode_lasttoken"], "mean": ["pooling_mode_mean_tokens"]}.get(
            cfg["pooling_mode"], [f"pooling_mode {cfg['pooling_mode']}"])
    if len(on) != 1 or on[0] not in ST_MODE_FLAGS:
        raise WeightLoadError(f"{cfg_file}: pooling {', '.join(on) or '(none given)'} is not supported; "
                              f"supported: pooling_mode_lasttoken, pooling_mode_mean_tokens")
    return PoolingConfig(ST_MODE_FLAGS[on[0]], ST_NORMALIZE in kinds, dim,
                         f"from {os.path.join(sub, 'config.json')} and modules.json")
