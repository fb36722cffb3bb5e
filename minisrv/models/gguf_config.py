"""A GGUF file's HF config, built as transformers builds it, from metadata read without its arrays.

Why: for the architectures minisrv serves, transformers' `AutoConfig.from_pretrained(gguf_file=...)` parses the
file with gguf's GGUFReader, which walks every metadata array element by element (the default model's 49,152-token
vocabulary and 48,900 merges): 10-12 s on 2 cores, the longest step of a first start. transformers' own fast
reader (`read_gguf_metadata`, which leaves arrays as their length) takes 0.1 s; this module then applies the same
mapping transformers' slow path applies (its tables: GGUF_CONFIG_MAPPING, GGUF_CONFIG_DEFAULTS_MAPPING) and builds
the config class from the result, as AutoConfig does.

Only the architectures listed in FAST_ARCHITECTURES take this path, and a file whose mapped keys hold an array
goes back to transformers' path (None here); tests/test_startup.py compares the two on GGUF files of each."""
from __future__ import annotations

from typing import Any, Dict, Optional

# llama.cpp architecture -> transformers' model_type, for the models minisrv serves from GGUF files
FAST_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe"}
TIED_ALWAYS = ("falcon", "bloom")  # transformers ties these whatever the tensors say (none of them served here)


def gguf_hf_config(path: str) -> Optional[Dict[str, Any]]:
    """transformers' config dict (`AutoConfig.from_pretrained(...).to_dict()`) of the GGUF file, or None where
    this path does not apply (then use transformers')."""
    from transformers.integrations.gguf import read_gguf_metadata
    metadata, tensor_names = read_gguf_metadata(path, _AllButTokenizer())
    parsed = config_from_metadata(metadata, tensor_names)
    if parsed is None:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return CONFIG_MAPPING[parsed["model_type"]].from_dict(parsed).to_dict()


def config_from_metadata(metadata: Dict[str, Any], tensor_names: tuple) -> Optional[Dict[str, Any]]:
    """The config part of transformers' load_gguf_checkpoint, step for step, for FAST_ARCHITECTURES."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    architecture = metadata.get("general.architecture")
    if architecture not in FAST_ARCHITECTURES:
        return None
    # transformers checks "mistral" against general.name as a one-element list: the name must be exactly that
    names = [metadata["general.name"]] if "general.name" in metadata else []
    updated = "mistral" if "llama" in architecture and "mistral" in names else FAST_ARCHITECTURES[architecture]
    if updated not in GGUF_CONFIG_MAPPING and architecture not in GGUF_CONFIG_MAPPING:
        return None
    config: Dict[str, Any] = {}
    config["tie_word_embeddings"] = all(n != "output.weight" for n in tensor_names) or architecture in TIED_ALWAYS
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    renames = GGUF_CONFIG_MAPPING
    for gguf_key, value in metadata.items():
        gguf_key = gguf_key.replace(architecture, updated)
        prefix, _, config_key = gguf_key.partition(".")
        if not (prefix in renames and config_key in renames[prefix]):
            continue
        renamed = renames[prefix][config_key]
        if renamed == -1 or renamed is None:
            continue
        if isinstance(value, (list, tuple)):
            return None  # an array: transformers' path has its own rules for them (one element -> a scalar)
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        config[renamed] = value
    if "model_type" not in config:
        return None
    if "vocab_size" not in config:  # as transformers: the vocabulary's length
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, int):
            return None
        config["vocab_size"] = tokens
    return config


class _AllButTokenizer:
    """The arrays read_gguf_metadata should read whole: all but the tokenizer's (the vocabulary and merges, left as
    their lengths), so that no config key's array passes for a number."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and not key.startswith("tokenizer.")
