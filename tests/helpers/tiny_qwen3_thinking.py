"""A tiny random-weight Qwen3 that thinks like Qwen3, for the reasoning tests (tests/test_reasoning_chat.py).

The word-level tokenizer of tiny_models.py has no characters of JSON, so a grammar after the thinking could not be
shown with it; this checkpoint takes the default model's byte-level tokenizer (as tiny_qwen2.py does) and adds
`<think>` and `</think>` as ordinary (non-special) tokens, as Qwen3's tokenizer has them, so their text stays in
the output. Its chat template is Qwen3's in small: ChatML turns, tools in a system turn with the Hermes call
format, and `enable_thinking` false writing an empty think block after the generation prompt.
`DEEPSEEK_TEMPLATE` is the same with DeepSeek-R1's habit: the generation prompt ends with `<think>\\n`, so the
output starts inside the thinking.
"""
from __future__ import annotations

import json
import os

import torch

from .tiny_models import init_weights

SEED = 31
THINK, END_THINK = "<think>", "</think>"

_TURNS = "".join([
    "{%- if tools -%}",
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}",
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}",
    "{{- '\\n</tools>\\nCall a function as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>' -}}",
    "{{- '<|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- for m in messages -%}",
    "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' -}}",
    "{%- endfor -%}",
])
CHAT_TEMPLATE = _TURNS + "".join([
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}",
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}",
    "{%- endif -%}{%- endif -%}",
])
DEEPSEEK_TEMPLATE = _TURNS + "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"


def build_tiny_qwen3_thinking(path: str) -> str:
    """Write the checkpoint (config.json, model.safetensors, the tokenizer with CHAT_TEMPLATE) into `path`."""
    import transformers

    from minisrv.checkpoints.loader import default_model_path, load_tokenizer

    tok = load_tokenizer(default_model_path())
    tok.add_tokens([THINK, END_THINK])  # ordinary added tokens: each one token, kept in decoded text
    tok.chat_template = CHAT_TEMPLATE
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(SEED)
    model = transformers.Qwen3ForCausalLM(cfg)
    init_weights(model, SEED)  # (no biases in Qwen3: the draws of tiny_qwen2's loop, in the same order)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]
    return path
