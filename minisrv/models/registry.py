"""config.json's `architectures` name -> model class: every supported architecture is the one Llama decoder
(llama.py), the differences between them being fields of ModelArgs."""
from __future__ import annotations

from typing import Type

from torch import nn

from .args import ARCHITECTURE_OF_MODEL_TYPE
from .llama import LlamaForCausalLM, LlamaForEmbedding

SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURE_OF_MODEL_TYPE.values())


class UnsupportedArchitecture(ValueError):
    pass


def model_class(architecture: str, embedding: bool = False) -> Type[nn.Module]:
    """embedding: the architecture's decoder without its LM head."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(f"architecture {architecture!r} is not supported; supported: "
                                      f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    return LlamaForEmbedding if embedding else LlamaForCausalLM
