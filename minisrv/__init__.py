"""minisrv: a compact, fast LLM inference server.

The offline API is importable without any GPU library: `from minisrv import LLM, SamplingParams`.
"""
from typing import TYPE_CHECKING

from minisrv.engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name):  # LLM and Engine pull in torch and transformers; load them on first use
    if name == "LLM":
        from minisrv.llm import LLM
        return LLM
    if name == "Engine":
        from minisrv.engine.engine import Engine
        return Engine
    if name == "EngineConfig":
        from minisrv.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)


if TYPE_CHECKING:
    from minisrv.config import EngineConfig
    from minisrv.engine.engine import Engine
    from minisrv.llm import LLM
