"""The Llama decoder, which Qwen2 (qkv bias), Qwen3 (q/k norm) and Mistral share: the differences are flags
in ModelArgs, read from config.json."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from .layers import Attention, GatedMLP, ModelArgs, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, rotary: RotaryEmbedding, fused: Optional[Any]) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_id, rotary, fused)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, fused)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, fused)

    def forward(self, x, residual, positions, attn):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int, fused: Optional[Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        rotary = RotaryEmbedding(args.head_dim, max_positions, args.rope_theta, args.rope_scaling, fused)
        self.layers = nn.ModuleList(DecoderLayer(args, i, rotary, fused) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, fused)

    def forward(self, input_ids, positions, attn):
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, attn)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int, fused_ops: Optional[Any] = None) -> None:
        """fused_ops: the fused-kernel module every layer uses (layers.fused_ops_for), or None for plain torch."""
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, max_positions, fused_ops)
        if args.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Callable) -> torch.Tensor:
        """Hidden states [T, hidden] of every token; logits are taken only where they are needed. attn: the step's
        attention.AttentionStep (backend and this step's metadata)."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.matmul(hidden, w.t()).float()


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    pass
