"""Tiny random-weight HF checkpoints of the four dense architectures, the mixtures of experts, the models with
sliding windows, Phi-3/Phi-4 and gpt-oss, with a word-level tokenizer, and the engine and sampling settings the CPU
tests run them with."""
from __future__ import annotations

import copy
import json
import os
import random
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from minisrv import LLM, SamplingParams

NUM_SPECIAL = 3  # <pad>=0, <bos>=1, <eos>=2; every other id i is the word "t{i}"
EOS_ID = 2

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}

# name -> (transformers config class name, config kwargs). Shapes: hidden 64, 4 heads / 2 kv heads, head_dim 16.
TINY_SPECS: Dict[str, Tuple[str, dict]] = {
    # llama3 rope scaling, untied lm_head
    "llama": ("LlamaConfig", dict(vocab_size=384, num_hidden_layers=2, max_position_embeddings=512,
                                  rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)),
    # qkv bias (Qwen2's default), tied embeddings
    "qwen2": ("Qwen2Config", dict(vocab_size=320, num_hidden_layers=2, max_position_embeddings=256,
                                  tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1000000.0})),
    # q/k RMSNorm, tied embeddings, 3 layers
    "qwen3": ("Qwen3Config", dict(vocab_size=448, num_hidden_layers=3, max_position_embeddings=256,
                                  tie_word_embeddings=True)),
    # Mistral (its default sliding window, 4096, is wider than the context), untied
    "mistral": ("MistralConfig", dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)),
}
ARCHS = list(TINY_SPECS)

# mixtures of experts, same attention shapes. Qwen3-MoE: 8 experts of width 32, top-2, layer 1 dense
# (mlp_only_layers); "qwen3_moe_top4": 4 experts, top-4 without renormalising, every second layer sparse
# (decoder_sparse_step); Mixtral: 4 experts of width 48, top-2; Qwen2-MoE: a shared expert with its sigmoid gate.
MOE_SPECS: Dict[str, Tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=384, num_hidden_layers=3, max_position_embeddings=256,
                                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)),
    "qwen3_moe_top4": ("Qwen3MoeConfig", dict(vocab_size=320, num_hidden_layers=2, max_position_embeddings=256,
                                              num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32,
                                              norm_topk_prob=False, decoder_sparse_step=2,
                                              tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=256,
                                      intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None, tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(vocab_size=320, num_hidden_layers=2, max_position_embeddings=256,
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, norm_topk_prob=False,
                                         tie_word_embeddings=False)),
}
MOE_ARCHS = list(MOE_SPECS)

# windows (8 tokens) shorter than the test prompts. Gemma 2: every other layer windowed, attention and final logits
# soft-capped, a query scale of its own (query_pre_attn_scalar); Gemma 3: windowed layers with their own rope base,
# q/k norms, global layers with linear rope scaling; "gemma3_mm": Gemma 3 inside a Gemma3ForConditionalGeneration, with
# a vision tower; Mistral windowed everywhere. Soft-caps small enough to change the scores of random weights.
WINDOW_SPECS: Dict[str, Tuple[str, dict]] = {
    "gemma2": ("Gemma2Config", dict(vocab_size=320, num_hidden_layers=3, max_position_embeddings=256, sliding_window=8,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", dict(vocab_size=384, num_hidden_layers=4, max_position_embeddings=256,
                                        sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16,
                                        rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=50000.0,
                                        rope_local_base_freq=500.0)),
    "gemma3_mm": ("Gemma3Config", dict(vocab_size=256, num_hidden_layers=3, max_position_embeddings=256,
                                       sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=16,
                                       rope_theta=20000.0, rope_local_base_freq=300.0)),
    "mistral_window": ("MistralConfig", dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=256,
                                             sliding_window=8, tie_word_embeddings=False)),
}
WINDOW_ARCHS = list(WINDOW_SPECS)

# Phi-3/Phi-4 (Phi3ForCausalLM: fused qkv_proj and gate_up_proj). "phi3": Phi-3-mini-4k's shape of config (full
# rotary, no scaling, untied); "phi4_mini": Phi-4-mini's (LongRoPE, rotary over 0.75 of each head, tied), with an
# original context of 32 positions that the test prompts cross.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}
PHI_SPECS: Dict[str, Tuple[str, dict]] = {
    "phi3": ("Phi3Config", dict(vocab_size=320, num_hidden_layers=2, max_position_embeddings=256,
                                tie_word_embeddings=False)),
    "phi4_mini": ("Phi3Config", dict(vocab_size=384, num_hidden_layers=2, max_position_embeddings=256,
                                     original_max_position_embeddings=32, partial_rotary_factor=0.75,
                                     rope_parameters=dict(LONGROPE), tie_word_embeddings=True)),
}
PHI_ARCHS = list(PHI_SPECS)

# gpt-oss (GptOssForCausalLM): windowed (8 tokens) and full layers alternating, sinks, biases everywhere, YaRN as
# gpt-oss sets it (truncate off) over an original context of 32 positions, 4 experts of width 64 (whole 32s for MXFP4
# on each of two ranks), top-2, a SwiGLU limit the random products cross
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 32}
GPT_OSS_SPECS: Dict[str, Tuple[str, dict]] = {
    "gpt_oss": ("GptOssConfig", dict(vocab_size=320, num_hidden_layers=3, max_position_embeddings=256,
                                     intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=8, swiglu_limit=1.0, rope_parameters=dict(YARN))),
}
GPT_OSS_ARCHS = list(GPT_OSS_SPECS)

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)


def make_config(name: str, **overrides):
    import transformers
    cls_name, kw = {**TINY_SPECS, **MOE_SPECS, **WINDOW_SPECS, **PHI_SPECS, **GPT_OSS_SPECS}[name]
    kw = copy.deepcopy({**COMMON, **kw, **overrides})  # (a config class may change its rope dict in place)
    if cls_name == "Gemma3Config":  # the language model's config inside a vision-language one
        text = {k: kw.pop(k) for k in list(kw) if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        return transformers.Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                         image_token_index=text["vocab_size"] - 1, **kw)
    return getattr(transformers, cls_name)(**kw)


def init_weights(model: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    """Weights large enough that greedy choices are rarely near-ties; norms, biases and attention sinks randomised
    too (sinks as large as scores, and exact in bfloat16 as the hub's are: FA3 takes them in bfloat16), so the tests
    notice if one of them is dropped or applied to the wrong tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * (torch.rand(p.shape, generator=g) - 0.5))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.copy_((1.5 * torch.randn(p.shape, generator=g)).bfloat16())
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer: ids 0-2 are <pad>/<bos>/<eos>, id i >= 3 is the word "t{i}". Decoding concatenates
    the words ("t12t7"), so a decoded text is exactly the concatenation of its tokens' strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    vocab.update({f"t{i}": i for i in range(NUM_SPECIAL, vocab_size)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)


def build_tiny_model(path: str, name: str, seed: int = 0, weight_std: float = 0.15, **config_overrides) -> str:
    """Save a random-weight HF checkpoint (config.json + model.safetensors + tokenizer) into `path`; weight_std: of
    the projections and embeddings (init_weights), which a wider model needs smaller for the same gain per layer."""
    import transformers
    cfg = make_config(name, **config_overrides)
    torch.manual_seed(seed)
    name = {"Gemma3TextConfig": "Gemma3ForCausalLM", "Gemma3Config": "Gemma3ForConditionalGeneration"}.get(
        type(cfg).__name__, type(cfg).__name__.replace("Config", "ForCausalLM"))
    model = getattr(transformers, name)(cfg)
    init_weights(model, seed, weight_std)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg.get_text_config().vocab_size)
    return path




def vocab_of(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)["vocab_size"]


PROMPT_LENS = [5, 40, 3, 23, 12, 31]


def make_prompts(vocab: int, lens: Sequence[int] = PROMPT_LENS, seed: int = 1234) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(NUM_SPECIAL, vocab) for _ in range(n)] for n in lens]


def make_llm(path: Optional[str], **kw) -> LLM:
    """A CPU engine on the torch backend; the prefix cache is off unless asked for (tests/test_prefix_cache.py
    runs the same checks with it on), so page accounting stays that of the requests alone."""
    opts = dict(attention_backend="torch", dtype="float32", log_level="warning", max_total_tokens=4096,
                disable_radix_cache=True)
    opts.update(kw)
    return LLM(model=path, **opts)


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
