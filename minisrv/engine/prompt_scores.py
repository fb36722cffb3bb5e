"""Prompt logprobs: the logprob (and top-n) of each prompt token under the model, computed during the request's
prefill from the hidden states the prefill makes anyway.

Position p's logits score token p + 1. An extend step scores the tokens its chunk's positions reach; a long prompt
is scored over several steps (its prefill is chunked, see the scheduler), and within a step PROMPT_LOGPROB_ROWS rows
at a time, so no [T, vocab] tensor is ever made for a long prompt. Results stay on the device side until the step
is read back, then land in `Request.prompt_logprobs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from minisrv.utils import to_device

from .request import Request, TokenLogprob
from .step_inputs import StepInputs

PROMPT_LOGPROB_ROWS = 1024  # prompt positions scored at once


@dataclass
class PromptScores:
    """Logprobs of some prompt tokens computed in a step (host copies, maybe pending): for owner k, the tokens at
    prompt positions positions[k]."""

    owners: List[Request]
    positions: List[List[int]]
    host: List[Optional[torch.Tensor]]  # chosen logprobs [R], top values [R, n], top ids [R, n]


def plan_prompt_scores(reqs: Sequence[Request], extend_lens: Sequence[int], inp: StepInputs) -> Optional[PromptScores]:
    """For an extend step with requests asking for prompt logprobs: the token rows whose next prompt token is
    scored this step go into `inp` (score_rows, score_targets, score_top_n); returns their owners and positions
    (host copies still to come), or None when nothing is scored."""
    rows, targets, owners, positions = [], [], [], []
    start = 0
    for r, n in zip(reqs, extend_lens):
        if r.params.prompt_logprobs is not None:
            plen = len(r.prompt_ids)
            pos = [p + 1 for p in range(r.num_cached, r.num_cached + n) if p + 1 < plen]
            if pos:
                owners.append(r)
                positions.append(pos)
                rows.extend(start + p - 1 - r.num_cached for p in pos)
                targets.extend(r.prompt_ids[p] for p in pos)
        start += n
    if not rows:
        return None
    inp.score_rows, inp.score_targets = rows, targets
    inp.score_top_n = max(r.params.prompt_logprobs for r in owners)
    return PromptScores(owners, positions, [])


def score_prompt_rows(model: torch.nn.Module, hidden: torch.Tensor, inp: StepInputs) -> List[Optional[torch.Tensor]]:
    """Chosen logprobs [R] and, when asked, top-n values and ids [R, n] of the rows `inp` scores."""
    rows, top_n, rows_at_once = inp.score_rows, inp.score_top_n, PROMPT_LOGPROB_ROWS
    idx = to_device([rows, inp.score_targets], torch.int64, hidden.device)
    chosen, top_v, top_i = [], [], []
    for c in range(0, len(rows), rows_at_once):
        lp = torch.log_softmax(model.compute_logits(hidden[idx[0, c:c + rows_at_once]]).float(), dim=-1)
        chosen.append(lp.gather(1, idx[1, c:c + rows_at_once, None]).squeeze(1))
        if top_n:
            t = lp.topk(top_n, dim=-1)
            top_v.append(t.values)
            top_i.append(t.indices)
    return [torch.cat(chosen), torch.cat(top_v) if top_n else None, torch.cat(top_i) if top_n else None]


def store_prompt_scores(scores: PromptScores) -> None:
    """Write a read-back step's scores into their requests' prompt_logprobs."""
    chosen, top_v, top_i = (None if x is None else x.tolist() for x in scores.host)
    k = 0
    for req, positions in zip(scores.owners, scores.positions):
        n_top = req.params.prompt_logprobs
        for p in positions:
            tops = dict(zip(top_i[k][:n_top], top_v[k][:n_top])) if n_top else {}
            req.prompt_logprobs[p] = TokenLogprob(req.prompt_ids[p], chosen[k], tops)
            k += 1
