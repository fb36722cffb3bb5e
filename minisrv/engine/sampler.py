"""Batched sampling on the device: one pass over [B, V] logits for the whole batch, no per-request Python loop
over the vocabulary.

Sampling is the Gumbel-max trick, argmax(logits / T - log E) with E ~ Exp(1), which draws exactly from
softmax(logits / T) after filtering. For a request with a seed, E comes from a counter-based hash of
(seed, output position, token id) rather than a shared generator, so its tokens depend only on its own seed:
the same seed gives the same output whatever else is in the batch, and a retracted request resumes the same
stream. Unseeded rows take E from torch's generator, which is one fused kernel; on CUDA, when no row of the step
has a seed or a top-k/top-p/min-p filter, FlashInfer's sampling kernel makes the same draw in one pass instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from minisrv import env
from minisrv.utils import cuda_import, host_tensor, to_device

from .grammar import apply_bitmask, fill_bitmask
from .request import Request

_M32 = 0xFFFFFFFF
# multipliers stay below 2**31 so every product of a 32-bit value fits in int64
_C1, _C2, _C3, _C4 = 0x7FEB352D, 0x1B873593, 0x27D4EB2F, 0x165667B1


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 15)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1), a pure function of (seed, step, token id). Seeds are signed 64-bit: both 32-bit
    halves are mixed in (the high half adds nothing when it is zero, so seeds below 2**31 keep their streams)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32((lo * _C3 & _M32) ^ _mix32(steps & _M32) ^ _mix32(hi * _C4 & _M32))  # [B]
    cols = _mix32(torch.arange(vocab, device=seeds.device, dtype=torch.int64) * _C4 & _M32)  # [V]
    h = _mix32(key[:, None] ^ cols[None, :])
    # 23 bits: k + 0.5 is exact in float32 for k < 2**23, so u <= 1 - 2**-24 (with 24 bits the top value rounds
    # to 1.0, and -log(-log(1)) = +inf would pick that token whatever its probability)
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def filter_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V] of tokens removed by top-k, then top-p (on the top-k renormalised), then min-p.

    top_k <= 0 disables top-k; top_p >= 1 disables top-p. The most likely token is never removed.
    """
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    rank = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    remove = rank >= k
    kept = sorted_p.masked_fill(remove, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    before = kept.cumsum(dim=-1) - kept  # probability mass strictly ahead of each token
    p = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, 2.0))[:, None]
    remove |= before >= p
    remove |= sorted_p < (min_p[:, None] * sorted_p[:, :1])
    remove[:, 0] = False
    return torch.zeros_like(remove).scatter_(1, order, remove)


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as device tensors (built once per step)."""

    temperature: torch.Tensor  # [B] float32 (0 for greedy rows: they take the argmax)
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, index of the token being sampled in each request's output
    all_greedy: bool
    any_greedy: bool
    need_filter: bool
    presence: Optional[torch.Tensor] = None  # [B] float32, penalties only when some row uses them
    frequency: Optional[torch.Tensor] = None
    repetition: Optional[torch.Tensor] = None
    output_ids: Optional[torch.Tensor] = None  # [B, L] int64 padded with -1
    seen_ids: Optional[torch.Tensor] = None  # [B, L'] prompt + output, padded with -1
    max_logprobs: int = -1  # -1: no row asked for logprobs
    seeded_rows: Optional[torch.Tensor] = None  # rows with a user-given seed (None: no such row)
    grammar_mask: Optional[torch.Tensor] = None  # [G, ceil(V/32)] int32 allowed tokens of the rows with a grammar
    grammar_rows: Optional[torch.Tensor] = None  # [G] those rows (None: every row); see engine/grammar.py
    bias_index: Optional[torch.Tensor] = None  # [2, N] (row, token) of every logit_bias entry of the step
    bias_values: Optional[torch.Tensor] = None  # [N] their biases
    forced_rows: Optional[torch.Tensor] = None  # [F] rows whose token is decided (a thinking budget's end) ...
    forced_ids: Optional[torch.Tensor] = None  # [F] ... and those tokens

    @classmethod
    def build(cls, reqs: List[Request], device: torch.device) -> "SamplingBatch":
        ps = [r.params for r in reqs]
        b = len(reqs)
        # two host->device copies: the float settings, then the integer ones
        floats = to_device([0.0 if p.greedy else p.temperature for p in ps] + [p.top_p for p in ps]
                           + [p.min_p for p in ps], torch.float32, device)
        ints = to_device([p.top_k if p.top_k > 0 else 0 for p in ps] + [r.sampling_seed for r in reqs]
                         + [r.num_output_tokens for r in reqs], torch.int64, device)
        greedy = [p.greedy for p in ps]
        need_filter = any((p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) and not p.greedy for p in ps)
        sb = cls(floats[:b], ints[:b], floats[b:2 * b], floats[2 * b:], ints[b:2 * b], ints[2 * b:],
                 all_greedy=all(greedy), any_greedy=any(greedy), need_filter=need_filter)
        if any(p.has_penalties for p in ps):
            pen = to_device([p.presence_penalty for p in ps] + [p.frequency_penalty for p in ps]
                            + [p.repetition_penalty for p in ps], torch.float32, device)
            sb.presence, sb.frequency, sb.repetition = pen[:b], pen[b:2 * b], pen[2 * b:]
            sb.output_ids = _pad([r.output_ids for r in reqs], device)
            if any(p.repetition_penalty != 1.0 for p in ps):
                sb.seen_ids = _pad([r.all_ids for r in reqs], device)
        seeded = [i for i, p in enumerate(ps) if p.seed is not None and not p.greedy]
        if seeded:
            sb.seeded_rows = to_device(seeded, torch.int64, device)
        wants = [p.logprobs for p in ps if p.logprobs is not None]
        sb.max_logprobs = max(wants) if wants else -1
        if any(r.grammar is not None for r in reqs):
            sb.grammar_mask, sb.grammar_rows = fill_bitmask(reqs, device)
        bias = [(i, t, v) for i, p in enumerate(ps) for t, v in (p.logit_bias or {}).items()]
        if bias:
            sb.bias_index = to_device([[i for i, _, _ in bias], [t for _, t, _ in bias]], torch.int64, device)
            sb.bias_values = to_device([v for _, _, v in bias], torch.float32, device)
        forced = [(i, r.thinking.forced()) for i, r in enumerate(reqs)
                  if r.thinking is not None and r.thinking.rule.budget is not None]  # only a budget forces
        forced = [(i, t) for i, t in forced if t is not None]
        if forced:
            both = to_device([i for i, _ in forced] + [t for _, t in forced], torch.int64, device)
            sb.forced_rows, sb.forced_ids = both[:len(forced)], both[len(forced):]
        return sb


def _pad(rows: List[List[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = host_tensor(r, torch.int64)
    return to_device(out, torch.int64, device)


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] occurrences of each token in the padded id rows (-1 is padding)."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    idx = torch.where(ids < 0, vocab, ids)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """OpenAI presence/frequency penalties on the output so far; HF-style repetition penalty on prompt + output."""
    vocab = logits.shape[-1]
    if sb.seen_ids is not None:
        seen = _counts(sb.seen_ids, vocab) > 0
        rep = sb.repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = _counts(sb.output_ids, vocab)
    return logits - sb.frequency[:, None] * counts - sb.presence[:, None] * (counts > 0).float()


def fused_sampling_kernel(device: torch.device) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """FlashInfer's sampling_from_logits (softmax sampling in one kernel) on CUDA when importable, else None.
    MINISRV_TORCH_SAMPLING=1 keeps the torch kernels. The model runner holds the one its steps use."""
    if env.TORCH_SAMPLING.get():
        return None
    return cuda_import(device, "flashinfer.sampling", "sampling_from_logits")


def sample(logits: torch.Tensor, sb: SamplingBatch, fused_sampling: Optional[Callable] = None
           ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """logits [B, V] (the head's dtype) -> (token ids [B], logprob of each chosen token [B], (top values, top ids)
    [B, n]). fused_sampling: a one-kernel draw for unseeded, unfiltered rows (fused_sampling_kernel), else torch's.

    Log-probabilities are the model's own distribution (before penalties, grammar masks, temperature and filtering).
    Everything is computed in float32, except a batch that only takes argmaxes: that reads the logits as they are
    (widening is exact, so the argmax, ties included, is the same).
    """
    if not (sb.all_greedy and sb.presence is None and sb.bias_index is None and sb.grammar_mask is None
            and sb.max_logprobs < 0):
        logits = logits.float()
    raw = logits
    if sb.presence is not None:
        logits = apply_penalties(logits, sb)
    if sb.bias_index is not None:  # in a copy: raw stays the model's
        logits = logits.index_put((sb.bias_index[0], sb.bias_index[1]), sb.bias_values, accumulate=True)
    if sb.grammar_mask is not None:  # disallowed tokens to -inf, in a copy (raw stays the model's)
        logits = apply_bitmask(logits, sb.grammar_mask, sb.grammar_rows)
    if sb.all_greedy:
        ids = logits.argmax(dim=-1)
    else:
        temp = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
        scaled = logits / temp[:, None]
        if sb.need_filter:
            scaled = scaled.masked_fill(filter_mask(torch.softmax(scaled, dim=-1), sb.top_k, sb.top_p, sb.min_p),
                                        float("-inf"))
        # Gumbel-max (module docstring): E from torch's generator, or from the hash for seeded rows
        fused = fused_sampling if sb.seeded_rows is None and not sb.need_filter else None
        if fused is not None:  # the same draw in one pass over the logits (FlashInfer, on CUDA)
            sampled = fused(scaled).to(torch.int64)
        elif sb.seeded_rows is None:
            e = torch.empty_like(scaled).exponential_()
        elif sb.seeded_rows.numel() == scaled.shape[0]:
            e = -torch.log(hashed_uniform(sb.seeds, sb.steps, logits.shape[-1]))
        else:
            e = torch.empty_like(scaled).exponential_()
            rows = sb.seeded_rows
            e[rows] = -torch.log(hashed_uniform(sb.seeds[rows], sb.steps[rows], logits.shape[-1]))
        if fused is None:
            sampled = scaled.sub_(e.log_()).argmax(dim=-1)
        ids = torch.where(sb.temperature > 0, sampled, logits.argmax(dim=-1)) if sb.any_greedy else sampled
    if sb.forced_rows is not None:  # decided whatever the logits say (engine/thinking.py); logprobs stay the model's
        ids = ids.index_put((sb.forced_rows,), sb.forced_ids)
    chosen_lp = top = None
    if sb.max_logprobs >= 0:
        lp = torch.log_softmax(raw, dim=-1)
        chosen_lp = lp.gather(1, ids[:, None]).squeeze(1)
        if sb.max_logprobs > 0:
            top = lp.topk(sb.max_logprobs, dim=-1)
            top = (top.values, top.indices)
    return ids, chosen_lp, top
