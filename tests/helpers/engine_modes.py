"""One engine against HF transformers (float64) in one of four ways, ENGINE_MODES: each prompt alone, batched, in
prefill chunks of 8 tokens, and over the prefix cache; greedy tokens and every computed logits row compared, the
pool checked after every step and free at the end. The shared body of the architectures' HF comparisons."""
from __future__ import annotations

from typing import List, Sequence

from .engine_watch import EngineWatch, assert_pool_free
from .hf_reference import assert_greedy_matches, hf_greedy
from .tiny_models import greedy, make_llm

ENGINE_MODES = {
    "alone": None,
    "batched": dict(page_size=1),
    "chunked": dict(chunked_prefill_size=8, max_prefill_tokens=16, page_size=3),
    "prefix_cache": dict(page_size=4, disable_radix_cache=False),
}


def check_greedy(ref_path: str, llm, prompts: Sequence[List[int]], n: int, what: str) -> None:
    """llm's greedy tokens for `prompts` (one batch) against HF's on the checkpoint at ref_path."""
    outs = llm.generate(list(prompts), greedy(n), use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref, scores = hf_greedy(ref_path, p, n)
        assert_greedy_matches(o.token_ids, ref, scores, f"{what} prompt {i} ({len(p)} tokens)")


def check_mode_against_hf(path: str, ref_path: str, prompts: List[List[int]], mode: str, what: str) -> None:
    """The checkpoint at `path` served in `mode` against HF on ref_path (the same weights, or their dequantised
    twin), 10 tokens a prompt. prefix_cache: the later prompts are made to read the first one's first 24 tokens."""
    if mode == "prefix_cache":
        prompts = [prompts[0]] + [prompts[0][:24] + p for p in prompts[1:]]
    llm = make_llm(path, **(ENGINE_MODES[mode] or {}))
    watch = EngineWatch(llm.engine)
    if mode == "alone":
        for p in prompts:
            check_greedy(ref_path, llm, [p], 10, f"{what} alone")
    elif mode == "prefix_cache":  # the first prompt's pages cached, then the others read its first 24 tokens
        check_greedy(ref_path, llm, prompts[:1], 10, f"{what} {mode}")
        check_greedy(ref_path, llm, prompts[1:], 10, f"{what} {mode}")
        assert llm.engine.num_cached_prompt_tokens >= 3 * 20
    else:
        check_greedy(ref_path, llm, prompts, 10, f"{what} {mode}")
    assert watch.check_logits(ref_path) >= len(prompts) * 10
    if mode == "chunked":
        assert watch.partial_extends > 0, "no prefill was chunked"
    if mode == "prefix_cache":
        assert llm.engine.flush_cache()
    assert_pool_free(llm.engine)


def check_two_ranks(path: str, ref_path: str, prompts: List[List[int]], what: str) -> None:
    """Two tensor-parallel ranks (chunked prefill, prefix cache on) give one rank's greedy tokens, and HF's."""
    one = [o.token_ids for o in make_llm(path).generate(prompts, greedy(8), use_tqdm=False)]
    with make_llm(path, tp_size=2, chunked_prefill_size=16, disable_radix_cache=False) as llm:
        two = [o.token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
    assert two == one
    for p, toks in zip(prompts, two):
        ref, scores = hf_greedy(ref_path, p, 8)
        assert_greedy_matches(toks, ref, scores, f"{what}, tp 2")
