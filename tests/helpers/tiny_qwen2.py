"""A tiny random-weight Qwen2 checkpoint that talks like Qwen2.5 about tools, for the tool-calling server tests.

The default model's chat template knows nothing of tools, so it cannot show that the server hands `tools` to the
template, reads the template's tool-call format (`--tool-call-parser auto`) or renders a conversation that carries
assistant tool calls and tool results. This checkpoint can: a Qwen2ForCausalLM with a few small layers and
seeded random weights, the default model's tokenizer (it has ChatML's <|im_start|> / <|im_end|>, as Qwen2.5 does)
saved beside it, and a chat template in Qwen2.5's format:

- with tools, the system turn lists each tool as JSON inside <tools></tools> and asks for calls as
  <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the Hermes format);
- an assistant turn's tool_calls are written back in that format (arguments objects as JSON, strings as they are);
- consecutive `tool` messages become <tool_response> blocks inside one user turn.

Its vocabulary is the tokenizer's, so every token the server can produce is one the grammar engine knows.
"""
from __future__ import annotations

import json
import os

import torch

SEED = 12

# Jinja, written as pieces so that no stray whitespace from the source layout reaches the prompt.
TOOLS_INTRO = ("\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
               "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>")
TOOLS_OUTRO = ("\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
               "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call>")
DEFAULT_SYSTEM = "You are a helpful assistant."

CHAT_TEMPLATE = "".join([
    # the system turn: the caller's system message (or a default), with the tools when there are any
    "{%- set has_system = messages and messages[0]['role'] == 'system' -%}",
    "{{- '<|im_start|>system\\n' -}}",
    "{%- if has_system -%}{{- messages[0]['content'] -}}{%- else -%}{{- '" + DEFAULT_SYSTEM + "' -}}{%- endif -%}",
    "{%- if tools -%}",
    "{{- '" + TOOLS_INTRO + "' -}}",
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}",
    "{{- '" + TOOLS_OUTRO + "' -}}",
    "{%- endif -%}",
    "{{- '<|im_end|>\\n' -}}",
    # the conversation
    "{%- for m in messages -%}",
    "{%- if m['role'] == 'system' and loop.first -%}",
    "{%- elif m['role'] == 'assistant' -%}",
    "{{- '<|im_start|>assistant' -}}",
    "{%- if m['content'] -%}{{- '\\n' + m['content'] -}}{%- endif -%}",
    "{%- for call in m['tool_calls'] or [] -%}",
    "{%- set fn = call['function'] if call['function'] is defined else call -%}",
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}",
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}"
    "{%- endif -%}",
    "{{- '}\\n</tool_call>' -}}",
    "{%- endfor -%}",
    "{{- '<|im_end|>\\n' -}}",
    "{%- elif m['role'] == 'tool' -%}",
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}",
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}",
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}",
    "{%- else -%}",
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
])


def build_tiny_qwen2(path: str) -> str:
    """Write the checkpoint (config.json, model.safetensors, the tokenizer with CHAT_TEMPLATE) into `path`."""
    import transformers

    from minisrv.checkpoints.loader import default_model_path, load_tokenizer

    tok = load_tokenizer(default_model_path())
    tok.chat_template = CHAT_TEMPLATE
    cfg = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(SEED)
    model = transformers.Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * (torch.rand(p.shape, generator=g) - 0.5))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen2ForCausalLM"]
    return path
