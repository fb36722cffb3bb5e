"""How each attention layer of a model weighs its keys, read from the model's config (`layer_attention`) and handed to
the attention backends, which pass it to their kernels or say that they cannot serve it (attention/__init__.py).

Beyond a causal softmax(q k^T * scale) v, a layer may have:
- a sliding window of W tokens: the query at position p sees keys p - W + 1 .. p (HF's `sliding_window` counts the
  query itself; FlashAttention's and FlashInfer's left window is W - 1);
- logit soft-capping: each score s (already scaled) becomes cap * tanh(s / cap) before the softmax (Gemma 2);
- its own softmax scale (Gemma's query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5).
Learned per-head attention sinks (gpt-oss) belong here too, as one more field that backends take or refuse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, FrozenSet, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from .args import ModelArgs

WINDOW = "sliding-window attention"
SOFTCAP = "attention logit soft-capping"


@dataclass(frozen=True)
class LayerAttention:
    scale: float
    window: Optional[int] = None  # None: the whole context
    softcap: Optional[float] = None

    @property
    def features(self) -> FrozenSet[str]:
        """What a backend must serve for this layer, beyond plain causal attention (a scale every backend takes)."""
        return frozenset(f for f, on in ((WINDOW, self.window), (SOFTCAP, self.softcap)) if on)

    @property
    def window_left(self) -> int:
        """The window as FlashAttention and FlashInfer count it (keys before the query's own); -1: none."""
        return -1 if self.window is None else self.window - 1


def layer_attention(args: "ModelArgs") -> Tuple[LayerAttention, ...]:
    """Each layer's attention, as the config says."""
    scale = args.query_pre_attn_scalar ** -0.5 if args.query_pre_attn_scalar else args.head_dim ** -0.5
    return tuple(LayerAttention(scale, args.sliding_window if i in args.sliding_layers else None,
                                args.attn_logit_softcap) for i in range(args.num_layers))


def plain_layers(num_layers: int, head_dim: int) -> Tuple[LayerAttention, ...]:
    return (LayerAttention(head_dim ** -0.5),) * num_layers


def features_of(layers: Sequence[LayerAttention]) -> FrozenSet[str]:
    return frozenset().union(*(a.features for a in layers))
