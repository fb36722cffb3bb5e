"""Helpers shared by the CPU tests (the fixtures that use them are in tests/conftest.py)."""
from .engine_watch import EngineWatch, assert_pool_free, tree_pages
from .hf_reference import TIE, assert_greedy_matches, hf_greedy, hf_logits, hf_model, rel_err
from .tiny_models import (ARCHS, COMMON, EOS_ID, LLAMA3_ROPE, MOE_ARCHS, MOE_SPECS, NUM_SPECIAL, PROMPT_LENS,
                          TINY_SPECS, WINDOW_ARCHS, build_tiny_model, greedy, init_weights, make_config, make_llm,
                          make_prompts, vocab_of, write_tokenizer)

__all__ = ["ARCHS", "COMMON", "EOS_ID", "LLAMA3_ROPE", "MOE_ARCHS", "MOE_SPECS", "NUM_SPECIAL", "PROMPT_LENS", "TIE",
           "TINY_SPECS", "WINDOW_ARCHS",
           "EngineWatch", "assert_greedy_matches", "assert_pool_free", "build_tiny_model", "greedy", "hf_greedy",
           "hf_logits", "hf_model", "init_weights", "make_config", "make_llm", "make_prompts", "rel_err", "tree_pages",
           "vocab_of", "write_tokenizer"]
