"""minisrv: a compact, fast LLM inference server.

The offline API is importable without any GPU library: `from minisrv import LLM, SamplingParams`.
"""
import importlib
from typing import TYPE_CHECKING

from minisrv.engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig"]
__version__ = "0.1.0"
_LAZY = {"LLM": "minisrv.llm", "Engine": "minisrv.engine.engine", "EngineConfig": "minisrv.config"}


def __getattr__(name):  # LLM and Engine pull in torch and transformers; load them on first use
    if name not in _LAZY:
        raise AttributeError(name)
    return getattr(importlib.import_module(_LAZY[name]), name)


if TYPE_CHECKING:
    from minisrv.config import EngineConfig
    from minisrv.engine.engine import Engine
    from minisrv.llm import LLM
