"""A thinking model's output, as the engine sees it: which tokens are thinking, when the thinking must stop, and
where a grammar starts.

Thinking models (Qwen3, DeepSeek-R1) reason between `<think>` and `</think>` (single tokens in every such model)
before the answer. Two things depend on where that boundary falls, decided token by token:

- a thinking budget: after `budget` thinking tokens, the end token is forced (`ThinkingState.forced`, applied by
  the sampler after everything else), so the model moves on to its answer.
- structured outputs: a JSON schema, regex or forced tool call describes the answer, not the thinking, which is
  free text: a request's grammar sees only the tokens after `</think>`; while the model thinks, its mask allows
  every token but the stop tokens, so that it cannot end without an answer (engine/grammar.py fills those rows).

Where the thinking starts is the chat template's business: DeepSeek-R1's ends the prompt with `<think>`, so the
output starts inside the thinking (`starts_inside`); Qwen3's leaves it to the model, whose first token is then
`<think>` or the answer begins.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BEFORE, THINKING, ANSWER = "before", "thinking", "answer"  # a ThinkingState's phases


@dataclass(frozen=True)
class ThinkingRule:
    """How one request's output delimits its thinking, in token ids. `SamplingParams.thinking` carries it."""

    end_id: int  # `</think>`
    start_id: Optional[int] = None  # `<think>`: without starts_inside, the output thinks only if it begins with it
    starts_inside: bool = True  # the prompt opened the thinking (it ends with `<think>`)
    budget: Optional[int] = None  # thinking tokens after which end_id is forced; None: no limit

    def problem(self) -> Optional[str]:
        """Why the rule cannot be used, or None; SamplingParams.validate reports it against `thinking_budget`
        (the only part a client sets; the ids are the server's)."""
        for name in ("end_id", "start_id", "budget"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                return f"{name} must be a non-negative integer, got {v!r}"
        if not self.starts_inside and self.start_id is None:
            return "a rule whose output does not start inside the thinking needs start_id"
        if not isinstance(self.starts_inside, bool):
            return f"starts_inside must be a boolean, got {self.starts_inside!r}"
        return None

    def ids(self) -> tuple:
        """Its token ids (checked against the vocabulary by check_request)."""
        return tuple(t for t in (self.end_id, self.start_id) if t is not None)


class ThinkingState:
    """Where one request's output is: before it (the first token decides whether it thinks), thinking, or answering.
    Advanced with every token that reaches the host, in order (before the grammar), so a retracted and recomputed
    request keeps its place; with a budget the request needs its previous token on the host (as a grammar does)."""

    def __init__(self, rule: ThinkingRule) -> None:
        self.rule = rule
        self.phase = THINKING if rule.starts_inside else BEFORE
        self.num_thinking = 0  # tokens generated inside the thinking, the tags left out
        self.num_seen = 0  # tokens of the output so far

    @property
    def thinking(self) -> bool:
        return self.phase == THINKING

    @property
    def answering(self) -> bool:
        return self.phase == ANSWER

    def advance(self, token_id: int) -> bool:
        """Take the output's next token; returns whether it belongs to the answer (a grammar then accepts it)."""
        self.num_seen += 1
        if self.phase == ANSWER:
            return True
        if self.phase == BEFORE:
            if token_id == self.rule.start_id:
                self.phase = THINKING
                return False
            self.phase = ANSWER  # it did not think: this token is already the answer's
            return True
        if token_id == self.rule.end_id:
            self.phase = ANSWER
        elif token_id != self.rule.start_id or self.num_seen > 1:  # nor is a `<think>` the output opens with
            self.num_thinking += 1
        return False

    def forced(self) -> Optional[int]:
        """The token the next step must sample (the end of the thinking, once the budget is spent), or None."""
        budget = self.rule.budget
        if budget is not None and self.phase == THINKING and self.num_thinking >= budget:
            return self.rule.end_id
        return None
