"""The Llama decoder, which every supported architecture is: how each differs is read into ModelArgs (args.py). A
layer's MLP is dense or sparse (moe.SparseMoE) as the config says for that layer; Gemma's layers norm the
attention's output before adding it, and the MLP's input and output (`gemma_norms`); each layer's window, scale,
soft-cap and sinks are the attention backend's (attention_options.py)."""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from minisrv.distributed import TensorParallel
from minisrv.kernels.cpu_decode import DecodeMeta
from minisrv.kernels.cpu_gemv import linear

from .args import ModelArgs
from .block_layers import BlockEmbedding, BlockLinear, block_kernels
from .layer_ops import LayerOps
from .layers import Attention, GatedMLP, RotaryEmbedding, VocabEmbedding, make_linear
from .moe import SparseMoE
from .planes_layers import PlanesEmbedding, PlanesLinear
from .norms import make_norm, reduce_add_norm
from .sharding import ShardPlan


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, rotary: RotaryEmbedding, ops: LayerOps,
                 plan: ShardPlan, tp: TensorParallel, quantization: Optional[str] = None) -> None:
        super().__init__()
        # with a fused all-reduce + add + norm, o and down return partial sums and the norm after each reduces them
        # (not Gemma's, whose norm after attention takes the whole sum before any add)
        self.partial = tp.fused_norm is not None and not args.gemma_norms
        projections = None if quantization == "mxfp4" else quantization  # ("mxfp4": the experts alone)
        self.self_attn = Attention(args, layer_id, rotary, ops, plan.num_heads, plan.num_kv_heads, tp,
                                   projections, reduce_output=not self.partial)
        sparse = layer_id in args.moe_layers
        if sparse:
            self.mlp = SparseMoE(args, plan.moe_intermediate, plan.shared_intermediate, ops, tp, quantization,
                                 reduce_output=not self.partial)
        else:
            self.mlp = GatedMLP(args.hidden_size, plan.intermediate, ops, tp, projections,
                                reduce_output=not self.partial, act=args.hidden_act)
        # the norms before qkv and a dense gate_up hand FP8 projections their input quantised (a router takes it
        # unquantised: the fused experts quantise it themselves)
        fp8, gemma = quantization == "fp8", args.gemma_norms
        norm = functools.partial(make_norm, args.hidden_size, args.rms_norm_eps, ops, plus_one=gemma)
        self.input_layernorm = norm(fp8)
        self.post_attention_layernorm = norm(fp8 and not sparse)
        self.pre_feedforward_layernorm = norm() if gemma else None
        self.post_feedforward_layernorm = norm() if gemma else None
        self.tp = tp

    def forward(self, x, residual, positions, attn):
        """x: the previous layer's output (a partial sum when `partial`, except for the first layer's input,
        the embedding, which has no residual yet)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = reduce_add_norm(self.tp, self.input_layernorm, x, residual, self.partial)
        h = self.self_attn(h, positions, attn)
        if self.post_feedforward_layernorm is not None:  # Gemma
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = reduce_add_norm(self.tp, self.post_attention_layernorm, h, residual, self.partial)
        return self.mlp(h), residual


class DecoderLayers(nn.ModuleList):
    """The decoder's layers, run one after another: (the last one's output, the residual stream). A step that
    passes `aux` gets appended to it the residual stream entering each layer of `aux_layer_ids` (what an EAGLE-3
    head reads: models/eagle3.py)."""

    aux_layer_ids: Tuple[int, ...] = ()

    def forward(self, x, positions, attn, aux: Optional[List[torch.Tensor]] = None):
        residual = None
        for i, layer in enumerate(self):
            if aux is not None and i in self.aux_layer_ids:
                aux.append(x.clone() if residual is None else x + residual)  # (the layers add in place)
            x, residual = layer(x, residual, positions, attn)
        return x, residual


class CpuFusedDecodeLayers(DecoderLayers):
    """Dense Llama-style layers in GGUF blocks on the CPU: a decode step over the paged attention (of up to the
    kernel's rows) runs them all in one C call (kernels/cpu_decode.py), the same numbers without the Python and
    torch calls between the kernels; other steps run them one by one."""

    def __init__(self, layers, kernel) -> None:
        super().__init__(layers)
        self.kernel = kernel

    def forward(self, x, positions, attn, aux: Optional[List[torch.Tensor]] = None):
        if isinstance(attn.meta, DecodeMeta) and self.kernel.takes(x):
            return self.kernel(self, x, positions, self[0].self_attn.rotary.cos_sin, attn.meta,
                               self.aux_layer_ids if aux is not None else (), aux)
        return super().forward(x, positions, attn, aux)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int, ops: LayerOps, plan: ShardPlan,
                 tp: TensorParallel, quantization: Optional[str] = None) -> None:
        super().__init__()
        if quantization == "gguf":
            self.embed_tokens = BlockEmbedding(plan.vocab_per_rank, args.hidden_size, block_kernels(ops))
        elif quantization == "gguf-planes":
            self.embed_tokens = PlanesEmbedding(plan.vocab_per_rank, args.hidden_size, plan.vocab_start, tp)
        else:
            self.embed_tokens = VocabEmbedding(plan.vocab_per_rank, args.hidden_size, plan.vocab_start, tp)
        rotary = RotaryEmbedding(args.head_dim, max_positions, args.rope_theta, args.rope_scaling, ops,
                                 args.rotary_dim)
        local = rotary if args.local_rope_theta is None else \
            RotaryEmbedding(args.head_dim, max_positions, args.local_rope_theta, None, ops)  # Gemma 3's local layers
        layers = [DecoderLayer(args, i, local if i in args.sliding_layers else rotary, ops, plan, tp, quantization)
                  for i in range(args.num_layers)]
        # the C layers have no qkv bias, q/k norm, soft-cap nor partial rotary, and one window for every layer (a
        # GGUF model in blocks is dense and on one rank)
        windows_differ = 0 < len(args.sliding_layers) < args.num_layers
        kernel = ops.decode_layers if quantization == "gguf" and not (
            args.qk_norm or args.attention_bias or args.gemma_norms or windows_differ
            or args.rotary_dim != args.head_dim) else None
        self.layers = CpuFusedDecodeLayers(layers, kernel) if kernel is not None else DecoderLayers(layers)
        self.norm = make_norm(args.hidden_size, args.rms_norm_eps, ops, plus_one=args.gemma_norms)
        self.embed_scale = args.hidden_size ** 0.5 if args.gemma_norms else None
        self.tp = tp

    def forward(self, input_ids, positions, attn, aux: Optional[List[torch.Tensor]] = None):
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # (by the scale rounded to the model's dtype, as transformers does)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype).item()
        x, residual = self.layers(x, positions, attn, aux)
        return reduce_add_norm(self.tp, self.norm, x, residual, self.layers[-1].partial)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int, ops: Optional[LayerOps] = None,
                 tp: Optional[TensorParallel] = None, quantization: Optional[str] = None,
                 embedding: bool = False) -> None:
        """ops: the elementwise kernels every layer shares (layer_ops.LayerOps; None: torch's).
        tp: this rank's place in a tensor-parallel group; the model holds that rank's shard (sharding.py).
        quantization: "fp8" for FP8 projections (qkv, o, gate_up, down; see fp8.py), the embedding, norms and
        lm_head staying in the model's dtype; "mxfp4" for a mixture's experts kept in MXFP4 (moe.py); "gguf" for
        a GGUF model's projections, embedding and lm_head kept in their blocks on the CPU (block_layers.py),
        "gguf-planes" on the GPU (planes_layers.py); a 4-bit checkpoint's Int4Scheme for 4-bit projections and
        experts (w4a16.py); None for the model's dtype.
        embedding: the decoder without its LM head, for an embedding model: the final norm's hidden states are
        pooled (engine/pooling.py). compute_logits, which only the GPU's activation probe calls for it, multiplies
        by the embedding matrix as a tied head would."""
        super().__init__()
        self.args = args
        self.tp = tp or TensorParallel.single()
        self.plan = ShardPlan.of(args, self.tp.rank, self.tp.size)
        self.ops = ops if ops is not None else LayerOps()
        self.model = LlamaModel(args, max_positions, self.ops, self.plan, self.tp, quantization)
        self.small_batch_linear = self.ops.small_batch_linear  # the CPU's, for decode logits
        head = quantization if quantization in ("gguf", "gguf-planes") else None  # (else the model's dtype)
        self.lm_head = None if args.tie_word_embeddings or embedding else \
            make_linear(args.hidden_size, self.plan.vocab_per_rank, False, head, self.ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Callable,
                aux: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Hidden states [T, hidden] of every token; logits are taken only where they are needed. attn: the step's
        attention.AttentionStep (backend and this step's metadata). aux: see DecoderLayers."""
        return self.model(input_ids, positions, attn, aux)

    def attention_sinks(self) -> Optional[List[torch.Tensor]]:
        """Each layer's sink logits (this rank's heads), for a model with sinks (attention_options.layer_attention)."""
        if not self.args.attention_sinks:
            return None
        return [layer.self_attn.sinks.detach() for layer in self.model.layers]

    def read_layers(self, layer_ids: Tuple[int, ...]) -> None:
        """Which layers' input a step that passes `aux` reads (an EAGLE-3 head's)."""
        if self.tp.enabled or not all(0 <= i < len(self.model.layers) for i in layer_ids):
            raise ValueError(f"cannot read layers {layer_ids} of a {len(self.model.layers)}-layer model"
                             + (" under tensor parallelism" if self.tp.enabled else ""))
        self.model.layers.aux_layer_ids = tuple(layer_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in the head's dtype on every rank (each rank's vocabulary rows, gathered). Not widened to
        float32 here (a pass over [N, vocab]): a greedy step's argmax is exact on them; the sampler widens where it
        computes."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.project(hidden) if isinstance(head, (BlockLinear, PlanesLinear)) else \
            linear(hidden, head.weight, None, self.small_batch_linear)
        if self.tp.enabled:
            logits = self.tp.all_gather_last(logits)[:, :self.plan.vocab_size]
        cap = self.args.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
