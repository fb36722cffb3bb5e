"""NgramProposer against a brute-force reference: for the longest n in the window whose suffix occurs earlier in
the request's own history, then (for that n, before a shorter one) in the released histories newest first, the
tokens after the most recent occurrence. The reference rescans everything on every call and keeps its own model
of the shared store (whole histories, oldest dropped while over capacity, a history over capacity cut to its tail)."""
import random
import time
from typing import Dict, List, Sequence

import pytest

from minisrv.engine.speculative import ngram
from minisrv.engine.speculative.ngram import NgramProposer


def last_occurrence_end(history: Sequence[int], gram: List[int], before: int) -> int:
    """The largest e < before (and >= len(gram)) with history[e - n:e] == gram, or -1."""
    n = len(gram)
    for end in range(before - 1, n - 1, -1):
        if list(history[end - n:end]) == gram:
            return end
    return -1


class ReferenceProposer:
    def __init__(self, num_draft: int, lo: int, hi: int, capacity: int) -> None:
        self.num_draft, self.lo, self.hi, self.capacity = num_draft, lo, hi, capacity
        self.released: List[List[int]] = []  # oldest first

    def propose(self, tokens: Sequence[int], num_draft=None) -> List[int]:
        k = self.num_draft if num_draft is None else num_draft
        history = list(tokens)
        length = len(history)
        for n in range(min(self.hi, length), self.lo - 1, -1):
            gram = history[length - n:]
            end = last_occurrence_end(history, gram, length)  # an earlier place: never the suffix itself
            if end >= 0:
                return history[end:end + k]
            for other in reversed(self.released):
                end = last_occurrence_end(other, gram, len(other))  # its very end has nothing after it
                if end >= 0:
                    return other[end:end + k]
        return []

    def release(self, tokens: Sequence[int]) -> None:
        self.released.append(list(tokens)[max(0, len(tokens) - self.capacity):])
        while sum(map(len, self.released)) > self.capacity:
            self.released.pop(0)


def grow(rng: random.Random, history: List[int], count: int, vocab: int) -> None:
    """Append `count` tokens: fresh random ones, or a copy of an earlier stretch (as a quoting model would)."""
    target = len(history) + count
    while len(history) < target:
        if history and rng.random() < 0.5:
            start = rng.randrange(len(history))
            history.extend(history[start:start + rng.randint(1, 8)][:target - len(history)])
        else:
            history.append(rng.randrange(vocab))


@pytest.mark.parametrize("seed", range(40))
def test_matches_reference_on_interleaved_growing_requests(seed):
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 8)
    num_draft = rng.randint(1, 6)
    capacity = rng.choice([0, 20, 60, 400])
    vocab = rng.choice([3, 6, 20])
    proposer = NgramProposer(num_draft, lo, hi, shared_capacity_tokens=capacity)
    reference = ReferenceProposer(num_draft, lo, hi, capacity)
    live: Dict[str, List[int]] = {}
    next_key = 0
    for _ in range(250):
        if len(live) < 3 or rng.random() < 0.05:
            history: List[int] = []
            grow(rng, history, rng.randint(0, 30), vocab)
            live[f"r{next_key}"] = history
            next_key += 1
        key = rng.choice(sorted(live))
        history = live[key]
        grow(rng, history, rng.choice([0, 1, 1, 1, 2, 5]), vocab)
        override = rng.choice([None, None, None, rng.randint(0, 8)])
        assert proposer.propose(key, history, override) == reference.propose(history, override), (key, history)
        if rng.random() < 0.04 or len(history) > 120:
            proposer.release(key, history)
            reference.release(history)
            del live[key]


def test_no_match_gives_nothing():
    proposer = NgramProposer(4)
    assert proposer.propose("a", []) == []
    assert proposer.propose("a", [7]) == []
    assert proposer.propose("a", [1, 2, 3, 4, 5]) == []


def test_longest_match_wins_and_continuation_stops_at_the_end():
    proposer = NgramProposer(5, min_match_window=1, max_match_window=3)
    # "1 2 3" occurs earlier followed by 9 8; "3" alone occurs later followed by 4 4 4 4 4.
    history = [1, 2, 3, 9, 8, 3, 4, 4, 4, 4, 4, 1, 2, 3]
    assert proposer.propose("a", history) == [9, 8, 3, 4, 4]
    # The only earlier "5 6" runs into the end: the draft is what there is.
    assert NgramProposer(4).propose("b", [0, 5, 6, 7, 5, 6]) == [7, 5, 6]
    # A run of one token: the suffix overlaps its most recent occurrence, which leaves one token.
    assert NgramProposer(4, max_match_window=3).propose("c", [2, 2, 2, 2, 2]) == [2]


def test_num_draft_override():
    proposer = NgramProposer(2)
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.propose("a", history) == [3, 4]
    assert proposer.propose("a", history, num_draft=5) == [3, 4, 5, 6, 1]
    assert proposer.propose("a", history, num_draft=0) == []


def test_a_history_that_is_not_an_extension_resets_the_key():
    proposer = NgramProposer(3)
    assert proposer.propose("a", [1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    # Shorter: the old entries (1 2 -> 3 4 1) must be gone.
    assert proposer.propose("a", [5, 1, 2]) == []
    assert proposer.propose("a", [5, 1, 2, 6, 5]) == [1, 2, 6]
    # Same length grown, but the last indexed token changed.
    assert proposer.propose("a", [5, 1, 2, 6, 7, 1, 2]) == [6, 7, 1]
    # Shorter with the same first token.
    assert proposer.propose("d", [1, 2, 3, 1, 2]) == [3, 1, 2]
    assert proposer.propose("d", [1, 2]) == []
    # Longer, first token the same, last indexed token changed: the old "7 7" must not match.
    assert proposer.propose("c", [1, 2, 7, 7, 5]) == []
    assert proposer.propose("c", [1, 2, 3, 4, 6, 7, 7]) == [7]
    # Other keys keep their own index.
    assert proposer.propose("b", [9, 8, 9]) == [8, 9]
    assert proposer.propose("a", [5, 1, 2, 6, 7, 1, 2, 6]) == [7, 1, 2]


def test_shared_store_serves_other_requests_after_release():
    proposer = NgramProposer(4, max_match_window=4)
    finished = [10, 11, 12, 13, 14, 15, 16]
    assert proposer.propose("a", finished) == []
    assert proposer.propose("b", [1, 11, 12]) == []  # "a" is still live: its history is not shared yet
    proposer.release("a", finished)
    assert proposer.propose("b", [1, 11, 12, 2, 11, 12]) == [2, 11, 12]  # own history first
    assert proposer.propose("c", [1, 12, 13]) == [14, 15, 16]
    # The own history's match is used only at lengths >= the shared one's: a longer shared match wins.
    assert proposer.propose("d", [13, 9, 12, 13]) == [14, 15, 16]
    assert proposer.propose("e", [5, 16]) == []  # the shared history's last token has nothing after it
    # The newest released history wins over an older one.
    proposer.release("f", [20, 12, 13, 99])
    assert proposer.propose("g", [12, 13]) == [99]


def test_shared_store_evicts_oldest_beyond_capacity():
    proposer = NgramProposer(2, max_match_window=2, shared_capacity_tokens=10)
    proposer.release("a", [1, 2, 3, 4])
    proposer.release("b", [5, 6, 7, 8])
    assert proposer.propose("x", [1, 2]) == [3, 4]
    proposer.release("c", [9, 10, 11])  # 11 tokens: "a" goes
    assert proposer.propose("y", [1, 2]) == []
    assert proposer.propose("z", [5, 6]) == [7, 8]
    assert proposer._shared.total_tokens == 7
    assert all(hid in proposer._shared.histories for hid, _ in proposer._shared.ends.values())
    proposer.release("d", list(range(100, 130)))  # over capacity alone: its last ten tokens stay, nothing else
    assert proposer.propose("w", [5, 6]) == []
    assert proposer.propose("v", [122, 123]) == [124, 125]
    assert proposer.propose("u", [100, 101]) == []
    assert proposer._shared.total_tokens == 10
    assert len(proposer._shared.ends) == 9 + 8  # its 1- and 2-grams with a token after them, and no stale entry


def test_zero_capacity_shares_nothing():
    proposer = NgramProposer(2, shared_capacity_tokens=0)
    proposer.release("a", [1, 2, 3])
    assert proposer.propose("b", [1, 2]) == []
    assert not proposer._shared.ends


def test_rejects_bad_settings():
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError):
        NgramProposer(4, min_match_window=0)
    with pytest.raises(ValueError):
        NgramProposer(4, min_match_window=5, max_match_window=4)


def test_long_prompt_is_indexed_quickly_and_incrementally(monkeypatch):
    """A first call over a 4,000-token prompt indexes it once, well within a step's time; each later call indexes
    only the appended tokens (one n-gram per n per new token), whatever the history's length."""
    rng = random.Random(0)
    prompt = [rng.randrange(50) for _ in range(4000)]
    assert min(_timed(lambda: NgramProposer(4).propose("a", prompt)) for _ in range(3)) < 0.05
    indexed = []
    counted = ngram._ngrams_ending
    monkeypatch.setattr(ngram, "_ngrams_ending", lambda tokens, n, start, stop: (
        indexed.append(stop - start), counted(tokens, n, start, stop))[1])
    proposer = NgramProposer(4, min_match_window=2, max_match_window=5)
    history = list(prompt)
    proposer.propose("a", history)
    assert sum(indexed) == sum(len(prompt) - n for n in range(2, 6))
    for appended in (1, 3):
        indexed.clear()
        history.extend(rng.randrange(50) for _ in range(appended))
        proposer.propose("a", history)
        assert sum(indexed) == 4 * appended


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start
