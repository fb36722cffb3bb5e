"""Which part of each weight one tensor-parallel rank holds, as Megatron splits a decoder.

- q, k, v and gate, up are split by output rows (column-parallel): rank r holds its heads / its slice of the MLP.
- o and down are split by input columns (row-parallel): each rank's product is a partial sum, all-reduced.
- Mixture-of-experts layers: every expert (and the shared expert) split as a dense MLP is, by its own width; the
  router and the shared expert's gate are replicated.
- The embedding and lm_head are split by vocabulary rows, padded to a multiple of the rank count.
- K/V heads are split across ranks, or replicated when there are fewer K/V heads than ranks (each rank then holds
  the one K/V head its query heads read).
- Norms are replicated; gpt-oss's attention sinks are split with their heads.
- Biases follow their rows (q, k, v, gate, up); a row-parallel layer's (o's and down's, gpt-oss) is added by rank 0
  alone, since every rank's product is a partial sum (`bias_on_rank_zero`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minisrv.utils import ceil_div

from .args import ModelArgs


class ShardingError(ValueError):
    pass


@dataclass(frozen=True)
class Slice:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a checkpoint tensor."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    num_heads: int  # query heads on this rank
    head_start: int
    num_kv_heads: int  # K/V heads on this rank
    kv_head_start: int
    intermediate: int  # MLP width on this rank: its slice starts at rank * intermediate (the experts' likewise)
    moe_intermediate: int  # each expert's width on this rank (0: a dense model)
    shared_intermediate: int  # the shared expert's width on this rank (0: none)
    vocab_per_rank: int  # rows of the embedding / lm_head on this rank (padded)
    vocab_start: int
    vocab_size: int  # the whole vocabulary
    head_dim: int

    @classmethod
    def of(cls, args: ModelArgs, rank: int = 0, size: int = 1) -> "ShardPlan":
        check_divisible(args, size)
        hq, hkv = args.num_heads // size, max(1, args.num_kv_heads // size)
        kv_start = rank * args.num_kv_heads // size  # with fewer K/V heads than ranks: the head rank r's queries read
        inter = args.intermediate_size // size
        moe, shared = args.moe_intermediate_size // size, args.shared_expert_intermediate_size // size
        vocab = ceil_div(args.vocab_size, size)
        return cls(rank, size, hq, rank * hq, hkv, kv_start, inter, moe, shared, vocab, rank * vocab, args.vocab_size,
                   args.head_dim)

    def slice_for(self, hf_name: str) -> Optional[Slice]:
        """The part of checkpoint tensor `hf_name` this rank holds; None: all of it."""
        if self.size == 1:
            return None
        if hf_name.endswith(".sinks"):
            return Slice(0, self.head_start, self.num_heads)
        if self.bias_on_rank_zero(hf_name):
            return None
        d, last = self.head_dim, hf_name.rsplit(".", 2)[-2]  # "model.layers.0.self_attn.q_proj.weight" -> "q_proj"
        # this rank's share of the MLP the tensor belongs to: an expert's, the shared expert's or the dense MLP's
        width = self.moe_intermediate if ".experts." in hf_name else \
            self.shared_intermediate if ".shared_expert." in hf_name else self.intermediate
        heads, kv_heads = (self.head_start * d, self.num_heads * d), (self.kv_head_start * d, self.num_kv_heads * d)
        mlp = (self.rank * width, width)
        # the vocabulary's rows that exist (the last rank's padding excluded)
        vocab = (self.vocab_start, max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start)))
        # (dim, (start, length)): column-parallel layers split by rows (dim 0), row-parallel ones by columns (dim 1)
        split = {"q_proj": (0, heads), "k_proj": (0, kv_heads), "v_proj": (0, kv_heads), "gate_proj": (0, mlp),
                 "up_proj": (0, mlp), "o_proj": (1, heads), "down_proj": (1, mlp), "embed_tokens": (0, vocab),
                 "lm_head": (0, vocab)}.get(last)
        return Slice(split[0], *split[1]) if split is not None else None

    @staticmethod
    def bias_on_rank_zero(hf_name: str) -> bool:
        """Whether `hf_name` is a row-parallel layer's bias, held whole and added by rank 0 alone (zeros elsewhere)."""
        return hf_name.endswith((".o_proj.bias", ".down_proj.bias"))


def check_divisible(args: ModelArgs, size: int) -> None:
    """Raises ShardingError saying which of the model's sizes `size` ranks cannot split."""
    if size < 1:
        raise ShardingError(f"tp size must be >= 1, got {size}")
    if size == 1:
        return
    problems = []
    if args.num_heads % size:
        problems.append(f"its {args.num_heads} attention heads")
    if args.num_kv_heads % size and size % args.num_kv_heads:
        problems.append(f"its {args.num_kv_heads} key/value heads (nor does it divide {size})")
    if args.intermediate_size % size:
        problems.append(f"its MLP width {args.intermediate_size}")
    if args.moe_intermediate_size % size:
        problems.append(f"its experts' width {args.moe_intermediate_size}")
    if args.shared_expert_intermediate_size % size:
        problems.append(f"its shared expert's width {args.shared_expert_intermediate_size}")
    if problems:
        raise ShardingError(f"tp size {size} does not divide {' and '.join(problems)}; choose a tp size that "
                            f"divides {args.num_heads} (the attention heads)")

