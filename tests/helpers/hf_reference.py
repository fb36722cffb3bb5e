"""The HF transformers reference, in float64: greedy `generate`, teacher-forced logits, and how a greedy run is
compared with it (a differing token is allowed only where HF's top two are tied)."""
from __future__ import annotations

from functools import lru_cache
from typing import List, Sequence, Tuple

import torch


@lru_cache(maxsize=None)
def hf_model(path: str, dtype: torch.dtype = torch.float64):
    from transformers import AutoModelForCausalLM
    # eager experts: transformers' default grouped_mm for mixtures of experts takes no float64
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                             experts_implementation="eager")
    return m.eval()


@lru_cache(maxsize=None)
def _hf_generate(path: str, prompt: Tuple[int, ...], n: int, extra: Tuple[Tuple[str, float], ...]):
    m = hf_model(path)
    ids = torch.tensor([list(prompt)])
    # eos_token_id=None: the engine runs with ignore_eos, so HF must neither stop at eos nor (min_new_tokens)
    # mask it out of the argmax; passing it as an argument overrides the saved generation_config
    with torch.no_grad():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                         output_logits=True, output_scores=True, **dict(extra))
    tokens = out.sequences[0, len(prompt):].tolist()
    scores = torch.stack([s[0] for s in out.scores])  # after HF's logits processors (what it chose from)
    assert len(tokens) == n
    # the reference itself: its greedy choice is the argmax of what its processors left
    assert tokens == scores.argmax(-1).tolist()
    return tokens, scores


def hf_greedy(path: str, prompt: Sequence[int], n: int, **extra) -> Tuple[List[int], torch.Tensor]:
    """HF `generate(do_sample=False)` on one prompt alone (no padding): (tokens, the [n, V] scores it chose from)."""
    return _hf_generate(path, tuple(prompt), n, tuple(sorted(extra.items())))


def hf_logits(path: str, ids: Sequence[int]) -> torch.Tensor:
    """Float64 logits [T, V] of a full causal forward over ids (teacher forcing). Cached: do not modify."""
    return _hf_logits(path, tuple(ids))


@lru_cache(maxsize=512)
def _hf_logits(path: str, ids: Tuple[int, ...]) -> torch.Tensor:
    m = hf_model(path)
    with torch.no_grad():
        return m(torch.tensor([list(ids)])).logits[0]


TIE = 1e-4  # top-2 gap (in logits) below which two tokens count as tied


def assert_greedy_matches(ours: Sequence[int], ref: Sequence[int], ref_scores: torch.Tensor, what: str = "") -> None:
    """Tokens equal, or equal up to a position where HF's top-2 are tied and ours picked one of the tied tokens
    (after which the continuations legitimately differ)."""
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens, HF made {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        top2 = ref_scores[i].topk(2)
        gap = (top2.values[0] - top2.values[1]).item()
        tied = gap < TIE and a in top2.indices.tolist()
        assert tied, (f"{what}: token {i} differs: ours {a}, HF {b} (HF top-2 gap {gap:.3g}, not a tie)\n"
                      f"ours {list(ours)}\nHF   {list(ref)}")
        return


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return (torch.linalg.vector_norm(ours.double() - ref) / torch.linalg.vector_norm(ref)).item()
