"""config.json's `architectures` name -> model class."""
from __future__ import annotations

from typing import Dict, Type

from torch import nn

from .llama import (LlamaForCausalLM, LlamaForEmbedding, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM,
                    Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)

MODEL_REGISTRY: Dict[str, Type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


class UnsupportedArchitecture(ValueError):
    pass


def model_class(architecture: str, embedding: bool = False) -> Type[nn.Module]:
    """embedding: the architecture's decoder without its LM head (every one shares LlamaForCausalLM's)."""
    try:
        cls = MODEL_REGISTRY[architecture]
        return LlamaForEmbedding if embedding else cls
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
