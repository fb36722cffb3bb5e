"""How each attention layer of a model weighs its keys, read from the model's config (`layer_attention`) and handed to
the attention backends, which pass it to their kernels or say that they cannot serve it (attention/__init__.py).

Beyond a causal softmax(q k^T * scale) v, a layer may have:
- a sliding window of W tokens: the query at position p sees keys p - W + 1 .. p (HF's `sliding_window` counts the
  query itself; FlashAttention's and FlashInfer's left window is W - 1);
- logit soft-capping: each score s (already scaled) becomes cap * tanh(s / cap) before the softmax (Gemma 2);
- its own softmax scale (Gemma's query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5);
- learned attention sinks (gpt-oss): a logit per query head that joins each row's softmax denominator as a key
  with no value would, so a query may give its keys less than all of its weight. They are weights of the model, read
  once it is loaded (`layer_attention(args, sinks)`); before that a sink layer's `sinks` is () (the feature alone).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, FrozenSet, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from .args import ModelArgs

WINDOW = "sliding-window attention"
SOFTCAP = "attention logit soft-capping"
SINKS = "learned attention sinks"


@dataclass(frozen=True)
class LayerAttention:
    scale: float
    window: Optional[int] = None  # None: the whole context
    softcap: Optional[float] = None
    sinks: Optional[Tuple[float, ...]] = None  # this rank's query heads' sink logits; None: no sinks

    @property
    def features(self) -> FrozenSet[str]:
        """What a backend must serve for this layer, beyond plain causal attention (a scale every backend takes)."""
        return frozenset(f for f, on in ((WINDOW, self.window), (SOFTCAP, self.softcap),
                                         (SINKS, self.sinks is not None)) if on)

    def sinks_tensor(self, device: torch.device) -> Optional[torch.Tensor]:
        """The sink logits as float32 [Hq] on `device`, or None."""
        return None if self.sinks is None else torch.tensor(self.sinks, dtype=torch.float32, device=device)

    @property
    def window_left(self) -> int:
        """The window as FlashAttention and FlashInfer count it (keys before the query's own); -1: none."""
        return -1 if self.window is None else self.window - 1


def layer_attention(args: "ModelArgs", sinks: Optional[Sequence[torch.Tensor]] = None
                    ) -> Tuple[LayerAttention, ...]:
    """Each layer's attention, as the config says; sinks: each layer's sink logits as the loaded model holds them
    (its `attention_sinks()`), for a model that has them."""
    scale = args.query_pre_attn_scalar ** -0.5 if args.query_pre_attn_scalar else args.head_dim ** -0.5
    return tuple(LayerAttention(scale, args.sliding_window if i in args.sliding_layers else None,
                                args.attn_logit_softcap,
                                (tuple(sinks[i].float().tolist()) if sinks else ()) if args.attention_sinks else None)
                 for i in range(args.num_layers))


def plain_layers(num_layers: int, head_dim: int) -> Tuple[LayerAttention, ...]:
    return (LayerAttention(head_dim ** -0.5),) * num_layers


def features_of(layers: Sequence[LayerAttention]) -> FrozenSet[str]:
    return frozenset().union(*(a.features for a in layers))
