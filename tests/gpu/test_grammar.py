"""Structured outputs on CUDA: the mask op gives what it gives on the CPU (and what xgrammar's Triton kernel gives),
grammar requests decode without synchronising the stream (the host-filled mask goes up from pinned memory without
waiting; the torch attention backend these tiny models run on synchronises by itself, and is left out), and overlap
on or off gives the same tokens. Tiny random models with the word-level tokenizer of the
CPU suite ("t12" is token 12): they need CUDA and xgrammar, no checkpoint.

    python3 -m pytest -q tests/gpu/test_grammar.py
"""
import importlib.util

import pytest
import torch

from minisrv import SamplingParams
from minisrv.engine.grammar import apply_bitmask

from ..helpers import EOS_ID, build_tiny_model, make_llm, make_prompts
from .common import stream_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("xgrammar") is None,
                                reason="needs CUDA and xgrammar")

TENS = r"(t1[0-9])+"  # tokens 10..19, then the stop token is allowed too


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", seed=3)


@pytest.mark.parametrize("rows", [None, [1, 4, 2]])
def test_mask_on_cuda_matches_cpu_and_xgrammar(rows):
    g = torch.Generator().manual_seed(0)
    b, vocab = 6, 151_936
    width = -(-vocab // 32)
    n = b if rows is None else len(rows)
    mask = torch.randint(-2 ** 31, 2 ** 31, (n, width), dtype=torch.int64, generator=g).to(torch.int32)
    logits = torch.randn(b, vocab, generator=g)
    idx = None if rows is None else torch.tensor(rows)
    cpu = apply_bitmask(logits, mask, idx)
    cuda = apply_bitmask(logits.cuda(), mask.cuda(), None if idx is None else idx.cuda())
    assert torch.equal(cuda.cpu(), cpu)
    if importlib.util.find_spec("triton") is not None:
        import xgrammar as xgr
        full = torch.full((b, width), -1, dtype=torch.int32)
        full[rows if rows is not None else slice(None)] = mask
        ref = logits.cuda()
        xgr.apply_token_bitmask_inplace(ref, full.cuda(), vocab_size=vocab, indices=rows)
        assert torch.equal(ref.cpu(), cpu)


def _mixed(prompts):
    return [(p, SamplingParams(temperature=0.0, max_tokens=12, regex=TENS) if i % 2 else
             SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)) for i, p in enumerate(prompts)]


def test_grammar_decode_steps_never_synchronise(qwen3):
    llm = make_llm(qwen3, dtype="bfloat16")  # the fused CUDA ops (FlashInfer's norms) take 16-bit types
    eng = llm.engine
    assert eng.parts.device.type == "cuda" and eng.overlap
    reqs = [eng.add_request(p, sp) for p, sp in _mixed(make_prompts(448, [5, 9, 13, 4, 7, 11], seed=3))]
    for _ in range(100):  # compiled, prefilled, decoding
        eng.step()
        failed = [(r.rid, r.finish_reason) for r in reqs if r.finished and r.finish_reason != "length"]
        assert not failed, failed
        if all(len(r.output_ids) >= 2 for r in reqs):
            break
    assert all(len(r.output_ids) >= 2 for r in reqs)
    # the torch attention backend synchronises by itself (tests/gpu/test_overlap.py checks fa and fi, which do not)
    syncs = [s for s in stream_syncs(lambda: [eng.step() for _ in range(6)])
             if "attention/torch_native.py:" not in s]
    assert not syncs, "grammar decode steps synchronised the stream at:\n" + "\n".join(syncs)
    for _ in range(100):
        if not eng.has_work():
            break
        eng.step()
    assert not eng.has_work()
    for r in reqs[1::2]:
        assert r.output_ids and all(10 <= t <= 19 for t in r.output_ids if t != EOS_ID), r.output_ids


def test_grammar_overlap_same_tokens(qwen3):
    items = _mixed(make_prompts(448, [5, 9, 13, 4, 7, 11, 6, 8], seed=4))
    outs = {}
    for overlap in (True, False):
        llm = make_llm(qwen3, dtype="bfloat16", disable_overlap_schedule=not overlap)
        assert llm.engine.overlap == overlap
        outs[overlap] = [o.token_ids for o in llm.generate([p for p, _ in items], [sp for _, sp in items],
                                                         use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
    for (_, sp), toks in zip(items, outs[True]):
        if sp.regex:
            assert toks and all(10 <= t <= 19 for t in toks if t != EOS_ID)
