"""A GGUF file's config as transformers builds it, for the keys minisrv reads, without transformers.

Why: `AutoConfig.from_pretrained(gguf_file=...)` walks every metadata array element by element (seconds for the
default model), and its imports cost a first start seconds more. Here the header as gguf_file.read_gguf reads it is
renamed as transformers' GGUF_CONFIG_MAPPING renames it, over its config classes' defaults; a key the file holds as
an array sends the file back to transformers. tests/test_gguf_conversion.py checks the ModelArgs of both.

A phi3 file (Phi-3, Phi-4) is read further than transformers reads it: its rotary width (partial rotary) and
LongRoPE, whose factors llama.cpp writes as two tensors (longrope_config); tests/test_phi3.py checks it against the
HF checkpoint the file was written from."""
from __future__ import annotations

from typing import Any, Dict, Optional

from gguf import GGUFReader, GGUFValueType

from .gguf_file import metadata_value

# llama.cpp architecture -> transformers' model_type, for the models minisrv serves from GGUF files
FAST_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe", "phi3": "phi3"}
_COMMON_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads",
                "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size"}
_EXPERT_KEYS = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"}
KEYS = {  # <model_type>.<gguf key> -> config key, as transformers' GGUF_CONFIG_MAPPING has them
    "llama": {**_COMMON_KEYS, "rope.dimension_count": "head_dim"},
    "mistral": {**_COMMON_KEYS, "rope.dimension_count": "head_dim"},
    "qwen2": _COMMON_KEYS, "qwen3": _COMMON_KEYS,
    "qwen2_moe": {**_COMMON_KEYS, **_EXPERT_KEYS},
    "qwen3_moe": {**_COMMON_KEYS, **_EXPERT_KEYS, "attention.key_length": "head_dim"},
    # (sliding_window 0: none, as llama.cpp writes Phi-4's)
    "phi3": {**_COMMON_KEYS, "rope.dimension_count": "rotary_dims", "attention.sliding_window": "sliding_window",
             "rope.scaling.original_context_length": "original_max_position_embeddings"},
}
TOKENIZER_KEYS = {"ggml.bos_token_id": "bos_token_id", "ggml.eos_token_id": "eos_token_id"}
_QWEN = dict(max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=None,
             eos_token_id=None, tie_word_embeddings=False, sliding_window=None, use_sliding_window=False)
DEFAULTS = {  # transformers' config classes' defaults (5.x) for the keys ModelArgs reads
    "llama": dict(max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, attention_bias=False),
    "mistral": dict(max_position_embeddings=131072, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1,
                    eos_token_id=2, tie_word_embeddings=False, sliding_window=4096),
    "qwen2": dict(_QWEN),
    "qwen3": dict(_QWEN, head_dim=128, attention_bias=False),
    "qwen2_moe": dict(_QWEN, sliding_window=0, qkv_bias=True, intermediate_size=5632, num_experts=60,
                      num_experts_per_tok=4, moe_intermediate_size=1408, norm_topk_prob=False,
                      shared_expert_intermediate_size=5632, decoder_sparse_step=1, mlp_only_layers=[]),
    # norm_topk_prob: transformers' GGUF_CONFIG_DEFAULTS_MAPPING sets it for qwen3_moe files
    "qwen3_moe": dict(_QWEN, attention_bias=False, intermediate_size=6144, num_experts_per_tok=8,
                      moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "phi3": dict(max_position_embeddings=4096, original_max_position_embeddings=4096, rope_theta=10000.0,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=32000, tie_word_embeddings=False, sliding_window=None),
}


def gguf_model_config(reader: GGUFReader) -> Optional[Dict[str, Any]]:
    """The config dict of the file (model_type and the keys above), or None where transformers must build it: an
    architecture not listed, or a mapped key held as an array. tie_word_embeddings and the experts' layout come
    from the tensor table afterwards (model_files._gguf_hf_config)."""
    architecture = metadata_value(reader, "general.architecture")
    if architecture not in FAST_ARCHITECTURES:
        return None
    # transformers reads llama.cpp's "llama" as Mistral only when general.name is exactly "mistral"
    model_type = "mistral" if architecture == "llama" and metadata_value(reader, "general.name") == "mistral" \
        else FAST_ARCHITECTURES[architecture]
    cfg: Dict[str, Any] = dict(DEFAULTS[model_type], model_type=model_type)
    keys = {f"{architecture}.{k}": v for k, v in KEYS[model_type].items()}
    keys.update({f"tokenizer.{k}": v for k, v in TOKENIZER_KEYS.items()})
    for gguf_key, config_key in keys.items():
        value = metadata_value(reader, gguf_key)
        if value is ...:
            return None
        if value is not None:
            cfg[config_key] = value
    rotary_dims = cfg.pop("rotary_dims", None)
    if rotary_dims and model_type == "phi3":
        cfg["partial_rotary_factor"] = rotary_dims / (cfg["hidden_size"] // cfg["num_attention_heads"])
    if "head_dim" not in cfg and model_type == "llama" and cfg.get("num_attention_heads"):
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if "vocab_size" not in cfg:  # as transformers: the vocabulary's length
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None or not tokens.types or tokens.types[0] != GGUFValueType.ARRAY:
            return None
        cfg["vocab_size"] = int(tokens.parts[4][0])  # an array field's parts: key length, key, type, item type, count
    return cfg


def longrope_config(reader: GGUFReader, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A phi3 file's config with its LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini), whose factors llama.cpp writes as
    the tensors rope_factors_long / rope_factors_short, and its attention factor as phi3.rope.scaling.attn_factor."""
    factors = {t.name: t.data for t in reader.tensors if t.name.startswith("rope_factors_")}
    if cfg.get("model_type") != "phi3" or not factors:
        return cfg
    rope = {"rope_type": "longrope", "long_factor": [float(x) for x in factors["rope_factors_long.weight"]],
            "short_factor": [float(x) for x in factors["rope_factors_short.weight"]]}
    attention = metadata_value(reader, "phi3.rope.scaling.attn_factor")
    if isinstance(attention, float):
        rope["attention_factor"] = attention
    return dict(cfg, rope_scaling=rope)
