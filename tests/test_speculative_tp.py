"""Speculative decoding (NGRAM) with tensor parallelism on the CPU: two ranks over gloo verify drafts and roll the
rejected positions back as one rank does, so their tokens are those of one rank without speculation.

Random weights do not copy their prompt, so the kept drafts come from the proposer's store of finished requests:
the second round of the same prompts finds the first round's histories and keeps whole runs of drafts; the first
round drafts from the requests' own histories and sees drafts rejected."""
from __future__ import annotations

import pytest

from minisrv import SamplingParams

from .helpers import greedy, make_llm, make_prompts, vocab_of

pytestmark = pytest.mark.slow  # spawns a tensor-parallel rank

MAX_TOKENS = 24


def test_two_speculating_ranks_give_one_plain_ranks_tokens(tiny_model):
    path = tiny_model("qwen3")
    prompts = make_prompts(vocab_of(path), [5, 23, 12], seed=5)
    params = [greedy(MAX_TOKENS), greedy(MAX_TOKENS),
              SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)]
    one = [o.token_ids for o in make_llm(path).generate(prompts, params, use_tqdm=False)]
    with make_llm(path, tp_size=2, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5) as llm:
        rounds = [[o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
        stats = llm.engine.stats()
        assert llm.engine.runner.tp.size == 2
    assert rounds[0] == one and rounds[1] == one
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], "no draft was rejected: no rollback ran"
