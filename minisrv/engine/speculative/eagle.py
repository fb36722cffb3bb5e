"""EAGLE-3 drafting: an EAGLE-3 head (models/eagle3.py) reading the target's own hidden states.

After each extend or verify step, the head runs over the step's positions whose next token is now known (a prompt's
tokens; a verify step's kept drafts and the target's token after them). Each entry pairs the target's layer inputs
at position p with the embedding of token p + 1, stores its key and value at p's slot of the head's own one-layer
cache (indexed by the target pool's slots, so the entries live and die with the target's pages, radix cache
included), and attends to the entries before it. The last entry predicts the first draft; the head then chains, each
draft's embedding with its own output in place of the target's hidden state, attending to the cache and to the
chain's entries so far (kept aside: their positions have no slots until the verify step), num_steps drafts in all.

A request whose newest token came from a step the head did not see (a plain decode step: a batch above the
speculation limit, a back-off, a step launched while its prefill was in flight) has no draft: `propose` returns None
and the speculator verifies it without drafts, which shows the head the target's state at its last token. Entries
of positions decoded plainly keep what their slot held: a draft is then less likely to be kept, and no output
changes, since the target verifies every draft.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from minisrv.config import EngineConfig
from minisrv.models.args import ModelArgs
from minisrv.models.eagle3 import Eagle3Head, attend, load_eagle3_head

from ..step_results import StepHidden

logger = logging.getLogger("minisrv")


def load_draft_head(cfg: EngineConfig, model: torch.nn.Module, args: ModelArgs, max_positions: int,
                    dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """The head of --speculative-draft-model-path, checked against the target, whose forward is set to read the
    layers the head needs."""
    head = load_eagle3_head(cfg.speculative_draft_model_path, max_positions, dtype, device)
    c, path = head.config, cfg.speculative_draft_model_path
    if c.target_hidden_size != args.hidden_size:
        raise ValueError(f"the EAGLE-3 head {path} reads hidden states of size {c.target_hidden_size}; the target "
                         f"model's are {args.hidden_size}: a head trained for another model")
    if c.vocab_size != args.vocab_size or int((head.d2t + torch.arange(len(head.d2t), device=device)).max()) \
            >= args.vocab_size:
        raise ValueError(f"the EAGLE-3 head {path} drafts over a vocabulary of {c.vocab_size} tokens; the target "
                         f"model's has {args.vocab_size}: a head trained for another model")
    layers = c.layers_read(args.num_layers)
    reads = head.fc.in_features // c.target_hidden_size
    if len(layers) != reads or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= args.num_layers:
        raise ValueError(f"the EAGLE-3 head {path} reads the inputs of layers {list(layers)}: expected {reads} "
                         f"distinct layers in increasing order among the target's {args.num_layers}")
    model.read_layers(layers)
    return head


class EagleProposer:
    """The speculator's proposer for EAGLE3 (speculator.Proposer), and what the engine hands each collected
    extend or verify step (`absorb`)."""

    def __init__(self, head: Eagle3Head, embed: Callable[[torch.Tensor], torch.Tensor], req_to_token: torch.Tensor,
                 num_slots: int, num_steps: int) -> None:
        c = head.config
        w = head.fc.weight
        self.head, self.embed, self.req_to_token, self.num_steps = head, embed, req_to_token, num_steps
        self.k = torch.zeros(num_slots, c.num_kv_heads, c.head_dim, dtype=w.dtype, device=w.device)
        self.v = torch.zeros_like(self.k)
        self._drafts: Dict[str, Tuple[int, List[int]]] = {}  # rid -> (the history length it follows, drafts)
        self._failed = False

    def propose(self, key: str, tokens: Sequence[int], num_draft: int) -> Optional[List[int]]:
        made = self._drafts.get(key)
        return made[1][:num_draft] if made is not None and made[0] == len(tokens) else None

    def release(self, key: str, tokens: Sequence[int]) -> None:
        self._drafts.pop(key, None)

    def absorb(self, step: StepHidden) -> None:
        """Run the head over a collected step (see the module docstring). A failure here costs drafts, not
        requests: it is logged and the requests decode on."""
        try:
            self._absorb(step)
        except Exception:  # noqa: BLE001 - drafting is an optimisation
            for r in step.reqs:
                self._drafts.pop(r.rid, None)
            if not self._failed:
                logger.exception("EAGLE-3 drafting failed; the requests go on without drafts")
                self._failed = True

    @torch.inference_mode()
    def _absorb(self, step: StepHidden) -> None:
        rows, pos, nxt, table_rows = [], [], [], []  # entries' rows in the step, positions, next tokens, table rows
        groups = []  # (request, its first entry, its entries, its first position)
        row0 = 0
        for r, start, n in zip(step.reqs, step.starts, step.lens):
            ids = r.all_ids
            m = 0 if r.finished else min(n, len(ids) - 1 - start)
            if m > 0:
                groups.append((r, len(pos), m, start))
                rows += range(row0, row0 + m)
                pos += range(start, start + m)
                nxt += ids[start + 1:start + 1 + m]
                table_rows += [r.row] * m
            row0 += n
        if not groups:
            return
        dev = self.k.device
        idx, positions, next_ids, trows = (torch.tensor(x, dtype=torch.int64, device=dev)
                                           for x in (rows, pos, nxt, table_rows))
        head = self.head
        q, k, v, residual = head.qkv(self.embed(next_ids).to(self.k.dtype), step.aux[idx].to(self.k.dtype), positions)
        slots = self.req_to_token[trows, positions].long()
        self.k[slots] = k
        self.v[slots] = v
        outs = []
        for r, first, m, start in groups:
            ctx = self.req_to_token[r.row, :start + m].long()
            outs.append(attend(q[first:first + m], self.k[ctx], self.v[ctx], causal=True))
        out = head.finish(torch.cat(outs), residual)
        # requests whose history ends right after their last entry's token draft now
        live = [(r, first + m - 1, start + m - 1) for r, first, m, start in groups if len(r.all_ids) == start + m + 1]
        if live:
            self._chain(live, out[torch.tensor([i for _, i, _ in live], device=dev)])

    def _chain(self, live: List[Tuple[object, int, int]], last: torch.Tensor) -> None:
        """num_steps drafts for each request of `live` (request, -, its last entry's position), from its last
        entry's output `last` [B, hidden]."""
        head, dev = self.head, self.k.device
        base = [p for _, _, p in live]
        ctxs = [self.req_to_token[r.row, :p + 1].long() for r, _, p in live]
        keys, vals = [[self.k[c]] for c in ctxs], [[self.v[c]] for c in ctxs]
        drafts: List[List[int]] = [[] for _ in live]
        tok = head.to_target_ids(head.logits(last).argmax(-1))
        for j in range(1, self.num_steps + 1):
            for d, t in zip(drafts, tok.tolist()):
                d.append(t)
            if j == self.num_steps:
                break
            positions = torch.tensor([p + j for p in base], dtype=torch.int64, device=dev)
            q, k, v, residual = head.qkv(self.embed(tok).to(self.k.dtype), last, positions)
            outs = []
            for i in range(len(live)):
                keys[i].append(k[i:i + 1])
                vals[i].append(v[i:i + 1])
                outs.append(attend(q[i:i + 1], torch.cat(keys[i]), torch.cat(vals[i]), causal=False))
            last = head.finish(torch.cat(outs), residual)
            tok = head.to_target_ids(head.logits(last).argmax(-1))
        for (r, _, p), d in zip(live, drafts):
            self._drafts[r.rid] = (p + 2, d)
