"""Cascade decode attention on a CPU: the host-side grouping of requests that share prefix pages (against brute
force on random prefix trees), the fi backend's two-level plan run through a torch stand-in for FlashInfer
(helpers/fake_flashinfer.py) against the torch backend, a whole engine on that backend against HF's float64 logits,
and the flag on the torch backend (which has no cascade path) changing nothing."""
from __future__ import annotations

import argparse
import dataclasses
import pickle
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from minisrv.attention.cascade import (MIN_SAVED_TOKENS, MIN_SAVED_TOKENS_EAGER, CascadePolicy, PrefixGroups,
                                       find_prefix_groups)
from minisrv.attention.base import HybridBackend
from minisrv.attention.torch_native import TorchNativeBackend
from minisrv.config import EngineConfig
from minisrv.engine.cuda_graph import CudaGraphRunner

from .helpers import cascade_scene as cs
from .helpers import fake_flashinfer
from .helpers import EngineWatch, greedy, make_llm, rel_err, vocab_of

# ---------------------------------------------------------------------------------------------------------------
# grouping


def _plan_ok(plan: PrefixGroups, n: int) -> None:
    assert sorted(plan.order) == list(range(n)), "the order must list every request once"
    assert all(s >= 2 for s in plan.sizes) and all(p >= 1 for p in plan.shared_pages)
    assert plan.num_grouped == sum(plan.sizes) and len(plan.leaders()) == plan.num_groups


@pytest.mark.parametrize("page_size", [1, 16])
def test_groups_of_the_standard_scene(page_size):
    sc = cs.standard_scene(page_size, torch.float32, 2, 8, torch.device("cpu"))
    names = [r[0] for r in cs.REQUESTS]
    plan = sc.groups(names)
    _plan_ok(plan, len(names))
    assert cs.named_groups(plan, names, page_size) == cs.EXPECTED_GROUPS
    # the requests in no group come last, in batch order
    assert [names[i] for i in plan.order[plan.num_grouped:]] == ["E", "F", "G"]
    shared = plan.shared_pages_in_order()
    assert shared[plan.num_grouped:] == [0, 0, 0]
    for i, n in zip(plan.order, shared):  # a request keeps at least the page its new token goes to
        assert n * page_size <= sc.cached[names[i]]
    assert plan.saved_tokens(page_size) == 5 * 640 + 2 * 320 + 1 * 272
    in_order = sc.groups(cs.IN_ORDER)
    assert in_order.order == tuple(range(len(cs.IN_ORDER)))
    assert pickle.loads(pickle.dumps(plan)) == plan  # it travels to the other tensor-parallel ranks in StepInputs


def test_shared_length_stops_where_members_diverge():
    # three requests share 20 pages; two of them share 10 more; one is shorter than the others
    trunk, branch = list(range(100, 120)), list(range(200, 210))
    pages = [trunk + branch + [300, 301], trunk + branch + [310, 311, 312], trunk + [320, 321, 322]]
    seqs = [len(p) * 4 for p in pages]
    plan = find_prefix_groups(pages, seqs, 4, min_shared_pages=16)
    assert plan.sizes == (3,) and plan.shared_pages == (20,)
    # alone, the two that share more share all 30
    plan = find_prefix_groups(pages[:2], seqs[:2], 4, min_shared_pages=16)
    assert plan.shared_pages == (30,)
    # but never the page holding a request's newest token (nor anything after it)
    plan = find_prefix_groups(pages[:2], [30 * 4 + 1, 40 * 4], 4, min_shared_pages=16)
    assert plan.shared_pages == (30,)
    plan = find_prefix_groups(pages[:2], [30 * 4, 40 * 4], 4, min_shared_pages=16)
    assert plan.shared_pages == (29,)


def test_a_common_first_page_does_not_merge_groups():
    """Requests that all start alike (a chat template's first page) but then carry two different system prompts
    make two groups, each with its whole system prompt."""
    head = [7]
    sys_a, sys_b = list(range(100, 130)), list(range(200, 230))
    pages = [head + s + [1000 + i] for i, s in enumerate([sys_a, sys_b, sys_a, sys_b, sys_a])]
    plan = find_prefix_groups(pages, [len(p) * 16 for p in pages], 16, min_shared_pages=16)
    _plan_ok(plan, 5)
    assert cs.named_groups(plan, "abcde", 1) == {("a", "c", "e"): 31, ("b", "d"): 31}


def test_thresholds():
    shared = list(range(100, 120))
    pages = [shared + [500], shared + [501], shared + [502]]
    seqs = [21 * 16] * 3
    assert find_prefix_groups(pages, seqs, 16, min_group=4, min_shared_pages=16) is None
    assert find_prefix_groups(pages, seqs, 16, min_shared_pages=21) is None
    saved = 2 * 20 * 16
    assert find_prefix_groups(pages, seqs, 16, min_shared_pages=16, min_saved_tokens=saved + 1) is None
    assert find_prefix_groups(pages, seqs, 16, min_shared_pages=16, min_saved_tokens=saved).sizes == (3,)
    assert find_prefix_groups([[1], [2]], [5, 5], 16) is None  # nothing to share
    with pytest.raises(ValueError):
        find_prefix_groups(pages, seqs, 16, min_group=1)
    # the policy: tokens to pages, and the saving it asks for depends on whether a CUDA graph would run instead
    policy = CascadePolicy(page_size=16, min_shared_tokens=320, min_saved_tokens=saved + 1,
                           min_saved_tokens_eager=saved)
    assert policy.plan(pages, seqs, graph_replay=True) is None
    assert policy.plan(pages, seqs, graph_replay=False).shared_pages == (20,)
    assert CascadePolicy(16, min_shared_tokens=321).plan(pages, seqs, graph_replay=False) is None
    assert MIN_SAVED_TOKENS > MIN_SAVED_TOKENS_EAGER


def _random_trie(rng: random.Random, n: int, page_size: int):
    """Requests as paths in a random prefix tree of pages, the way the prefix cache shares them: page lists and
    KV lengths (each request's newest token in a page of its own)."""
    fresh = iter(range(1, 1 << 30))
    children = {}  # (parent path) -> list of child pages

    def walk(depth_left, path):
        if depth_left == 0:
            return path
        kids = children.setdefault(tuple(path), [])
        if kids and rng.random() < 0.8:
            page = rng.choice(kids)
        else:
            page = next(fresh)
            kids.append(page)
        return walk(depth_left - 1, path + [page])

    pages, seqs = [], []
    for _ in range(n):
        depth = rng.randint(1, 12)
        path = walk(depth, [])
        own = rng.randint(0, 2 * page_size)  # tokens of its own past the shared part
        total = depth * page_size + own
        path = path + [next(fresh) for _ in range(-(-(total + 1) // page_size) - depth)]
        pages.append(path)
        seqs.append(total + 1)
    return pages, seqs


@pytest.mark.parametrize("seed", range(30))
def test_groups_match_brute_force_on_random_prefix_trees(seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 16])
    n = rng.randint(2, 40)
    min_pages = rng.randint(1, 4)
    pages, seqs = _random_trie(rng, n, page_size)
    plan = find_prefix_groups(pages, seqs, page_size, min_shared_pages=min_pages)

    def limit(i):
        return (seqs[i] - 1) // page_size  # full pages before the newest token's

    # brute force: requests i and j belong together iff they hold the same page at index min_pages - 1
    eligible = [i for i in range(n) if limit(i) >= min_pages]
    buckets = {}
    for i in eligible:
        buckets.setdefault(pages[i][min_pages - 1], []).append(i)
    want = {}
    for members in buckets.values():
        if len(members) < 2:
            continue
        top = min(limit(i) for i in members)
        shared = max(k for k in range(min_pages, top + 1) if len({tuple(pages[i][:k]) for i in members}) == 1)
        want[tuple(members)] = shared
    if not want:
        assert plan is None
        return
    _plan_ok(plan, n)
    got, start = {}, 0
    for size, shared in zip(plan.sizes, plan.shared_pages):
        got[tuple(sorted(plan.order[start:start + size]))] = shared
        start += size
    assert got == want


# ---------------------------------------------------------------------------------------------------------------
# the fi backend's cascade path, through the stand-in FlashInfer


@pytest.fixture
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    from minisrv.attention import fi
    monkeypatch.setattr(fi, "WORKSPACE_BYTES", 1024)
    return fi


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fi_cascade_step_matches_plain_decode_and_torch(fake_fi, page_size, hq, hkv):
    d = 8
    sc = cs.standard_scene(page_size, torch.float32, hkv, d, torch.device("cpu"))
    for names in ([r[0] for r in cs.REQUESTS], cs.IN_ORDER):
        plan = sc.groups(names)
        qkv = cs.random_qkv(sc, len(names), hq)
        pools = {"cascade": sc.clone_pool(), "plain": sc.clone_pool(), "torch": sc.clone_pool()}
        outs = {}
        for what, pool in pools.items():
            if what == "torch":
                backend = TorchNativeBackend(pool, sc.table, hq)
            else:
                backend = fake_fi.FlashInferBackend(pool, sc.table, hq)
            batch = sc.decode_batch(names, plan if what == "cascade" else None)
            outs[what] = cs.run_layers(backend, batch, qkv)
            if what == "cascade":
                meta = backend.prepare(batch)
                assert isinstance(meta, fake_fi.FICascadeMeta)
                assert (meta.order is None) == (names == cs.IN_ORDER)
                assert meta.num_grouped == plan.num_grouped
        for layer in range(cs.NUM_LAYERS):
            for what in ("cascade", "plain"):
                err = rel_err(outs[what][layer], outs["torch"][layer])
                assert err < 1e-5, f"{what}, layer {layer}: relative error {err:.2e}"
            assert torch.equal(pools["cascade"].kv[layer], pools["torch"].kv[layer])


@pytest.mark.slow
def test_the_gpu_tests_run_here(fake_fi, monkeypatch):
    """tests/gpu/test_cascade.py's kernel-level tests, through the stand-in on the CPU (the benchmark-shape one at a
    small size): the one GPU run meets no bug of the test's own making."""
    from .gpu import test_cascade as gpu
    cpu = torch.device("cpu")
    monkeypatch.setattr(gpu, "_dev", lambda: cpu)
    monkeypatch.setattr(gpu, "_need_fi", lambda: None)
    gpu.test_cascade_step_matches_plain_fi_and_torch(16)
    gpu.test_cascade_step_matches_plain_fi_and_torch(1)
    gpu.test_cascade_step_on_tensor_core_decode()
    sc, names = cs.many_groups_scene(16, torch.bfloat16, 2, 8, cpu, 3, 4, 256)
    plan, outs, _ = gpu._three_ways(sc, names, 4, reference=False)
    assert plan.sizes == (4,) * 3 and plan.shared_pages == (16,) * 3
    assert gpu._rel_err(outs["cascade"][1], outs["plain"][1]) < gpu.TOL
    prompts = gpu._shared_prompts()
    assert len(prompts) == 36 and sum(len(p) > 1024 for p in prompts) == 32


def test_fi_cascade_refuses_a_plan_that_takes_the_current_page(fake_fi):
    sc = cs.standard_scene(16, torch.float32, 2, 8, torch.device("cpu"))
    names = ["A0", "A1"]
    bad = PrefixGroups((0, 1), (2,), (41,))  # A0 holds 640 tokens: page 40 is the one its new token goes to
    backend = fake_fi.FlashInferBackend(sc.pool, sc.table, 4)
    with pytest.raises(ValueError):
        backend.prepare(sc.decode_batch(names, bad))


def test_cuda_graph_runner_leaves_cascade_steps_to_eager():
    sc = cs.standard_scene(16, torch.float32, 2, 8, torch.device("cpu"))
    runner = SimpleNamespace(max_bs=64)
    assert CudaGraphRunner.can_run(runner, sc.decode_batch(["A0", "A1", "E"]))
    assert not CudaGraphRunner.can_run(runner, sc.decode_batch(["A0", "A1", "E"], sc.groups(["A0", "A1", "E"])))


def _shared_prompts(vocab: int, seed: int = 3):
    """Two system prompts of 40 tokens, four requests on each with a few tokens of their own, and one alone."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(2)]
    prompts = [systems[i % 2] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))] for i in range(8)]
    return prompts + [[rng.randrange(3, vocab) for _ in range(30)]]


@pytest.mark.slow  # whole engines against HF, about 25 s on 2 cores
@pytest.mark.parametrize("hybrid", [False, True], ids=["fi", "torch,fi"])
def test_engine_on_fi_cascade_matches_hf_and_plain_decode(tiny_model, fake_fi, hybrid):
    """The whole engine (prefix cache on, so requests share pages) on the fi backend over the stand-in kernels (or
    decoding on it, prefilling on torch): with cascade planned on every decode step that has a group, each logits
    row equals HF's float64 one, and the tokens equal those of the same engine without cascade."""
    path = tiny_model("qwen3")
    prompts = _shared_prompts(vocab_of(path))
    tokens = {}
    for cascade in (False, True):
        llm = make_llm(path, disable_radix_cache=False, page_size=4)
        eng = llm.engine
        runner = eng.runner
        fi = fake_fi.FlashInferBackend(eng.parts.pool, eng.parts.table.table, eng.parts.args.num_heads)
        backend = HybridBackend(runner.backend, fi) if hybrid else fi
        assert backend.supports_cascade
        policy = None
        if cascade:  # what setup does for --enable-cascade-attention, with thresholds this small model can meet
            backend.init_cascade_state()
            policy = CascadePolicy(page_size=4, min_shared_tokens=8, min_saved_tokens=0, min_saved_tokens_eager=0)
        runner.use_parts(dataclasses.replace(runner.parts, backend=backend, cascade=policy))
        watch = EngineWatch(eng)
        outs = llm.generate(prompts, greedy(8), use_tqdm=False)
        tokens[cascade] = [o.token_ids for o in outs]
        assert watch.check_logits(path) >= len(prompts) * 8
        watch.assert_idle()
        if cascade:
            assert runner.num_cascade_steps >= 5, "the shared prompts' decode steps should run as cascade"
            assert fi.shared_wrapper.plans == runner.num_cascade_steps
        else:
            assert runner.num_cascade_steps == 0 and fi.shared_wrapper is None
    assert tokens[True] == tokens[False]


# ---------------------------------------------------------------------------------------------------------------
# the flag


def test_flag_parses_and_defaults_off():
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    assert EngineConfig.from_args(p.parse_args([])).enable_cascade_attention is False
    assert EngineConfig.from_args(p.parse_args(["--enable-cascade-attention"])).enable_cascade_attention is True


@pytest.mark.slow
def test_flag_on_the_torch_backend_changes_nothing(tiny_model):
    """The torch backend has no cascade path: the flag is ignored (with a warning) and greedy output is the same."""
    path = tiny_model("qwen3")
    prompts = _shared_prompts(vocab_of(path))
    outs = {}
    for flag in (False, True):
        llm = make_llm(path, disable_radix_cache=False, page_size=4, enable_cascade_attention=flag)
        assert llm.engine.runner.cascade is None
        outs[flag] = [o.token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
        assert llm.engine.runner.num_cascade_steps == 0
    assert outs[True] == outs[False]
