"""Cascade decode attention with the real FlashInfer, on a CUDA GPU.

One step over a batch whose requests share prefixes of several lengths (helpers/cascade_scene.py, which the CPU suite
runs through a stand-in FlashInfer) equals plain fi decode and the torch backend, and writes the same pool; the same
at the offline benchmark's shape (8 prefixes of 4,096 tokens, 32 requests on each), where the attention time of
both ways is printed. End to end, on the random-weight checkpoint: greedy tokens with cascade on equal those with it
off (up to bf16 near-ties), and cascade steps never synchronise the stream (overlap scheduling is kept).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from minisrv import LLM, SamplingParams
from minisrv.attention import create_backend
from minisrv.attention.torch_native import TorchNativeBackend

from ..helpers import cascade_scene as cs
from .common import (CKPT, assert_same_up_to_ties, free_cuda, requires_ckpt, skip_unless_runs, start_decoding,
                     stream_syncs)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = 1e-2  # relative, bf16


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _need_fi() -> None:
    skip_unless_runs("fi")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12)).item()


def _three_ways(sc: cs.SharedPrefixScene, names, hq: int, reference: bool = True):
    """One decode step of `names` as cascade, as plain fi decode and (reference) on the torch backend, each on its
    own copy of the pool: outputs per layer, and the pools after the step."""
    plan = sc.groups(names)
    qkv = cs.random_qkv(sc, len(names), hq)
    outs, pools = {}, {}
    for what in ("cascade", "plain", "torch") if reference else ("cascade", "plain"):
        pools[what] = pool = sc.clone_pool()
        backend = TorchNativeBackend(pool, sc.table, hq) if what == "torch" else create_backend("fi", pool,
                                                                                                 sc.table, hq)
        outs[what] = cs.run_layers(backend, sc.decode_batch(names, plan if what == "cascade" else None), qkv)
    if sc.device.type == "cuda":  # (the CPU suite runs this set-up through its stand-in FlashInfer)
        torch.cuda.synchronize()
    return plan, outs, pools


@pytest.mark.parametrize("page_size", [16, 1])
def test_cascade_step_matches_plain_fi_and_torch(page_size, hq=16, hkv=8, d=128):
    """Qwen3-0.6B's heads: GQA 2, which FlashInfer decodes on CUDA cores."""
    _need_fi()
    sc = cs.standard_scene(page_size, torch.bfloat16, hkv, d, _dev())
    for names in ([r[0] for r in cs.REQUESTS], cs.IN_ORDER):
        plan, outs, pools = _three_ways(sc, names, hq)
        if len(names) == len(cs.REQUESTS):
            assert cs.named_groups(plan, names, page_size) == cs.EXPECTED_GROUPS
        for layer in range(cs.NUM_LAYERS):
            got = outs["cascade"][layer]
            assert got.shape == (len(names), hq, d) and torch.isfinite(got.float()).all()
            for ref in ("plain", "torch"):
                err = _rel_err(got, outs[ref][layer])
                assert err < TOL, f"{names[:3]}..., layer {layer}: cascade vs {ref}: relative error {err:.3g}"
            assert torch.equal(pools["cascade"].kv[layer], pools["torch"].kv[layer])


def _time_layer(backend, batch, q, k, v, iters: int = 20) -> float:
    """Mean ms of one layer's store-and-attend (the plan, made once per step, is outside)."""
    meta = backend.prepare(batch)
    backend.forward(q, k, v, 0, meta)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        backend.forward(q, k, v, 0, meta)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def test_cascade_at_the_prefix_benchmark_shape():
    """8 prefixes of 4,096 tokens, 32 requests on each, Qwen3-0.6B's heads, page size 16: cascade equals plain fi
    decode (the torch reference would need tens of GiB here), and the attention time of both is printed."""
    _need_fi()
    hq, hkv, d = 16, 8, 128
    sc, names = cs.many_groups_scene(16, torch.bfloat16, hkv, d, _dev(), 8, 32, 4096)
    plan, outs, _ = _three_ways(sc, names, hq, reference=False)
    assert plan.sizes == (32,) * 8 and plan.shared_pages == (256,) * 8
    for layer in range(cs.NUM_LAYERS):
        err = _rel_err(outs["cascade"][layer], outs["plain"][layer])
        assert err < TOL, f"layer {layer}: cascade vs plain: relative error {err:.3g}"
    q, k, v = cs.random_qkv(sc, len(names), hq)[0]
    times = {}
    for what in ("plain", "cascade"):
        backend = create_backend("fi", sc.clone_pool(), sc.table, hq)
        times[what] = _time_layer(backend, sc.decode_batch(names, plan if what == "cascade" else None), q, k, v)
    print(f"\nprefix-benchmark shape, one layer's decode attention (256 requests, 8 x 4096 shared tokens): plain "
          f"{times['plain']:.3f} ms, cascade {times['cascade']:.3f} ms ({times['plain'] / times['cascade']:.2f}x)")


# ---------------------------------------------------------------------------------------------------------------
# end to end


def _shared_prompts(num_prefixes: int = 4, per_prefix: int = 8, prefix_len: int = 1024, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(0, 10000, (prefix_len,), generator=g).tolist() for _ in range(num_prefixes)]
    prompts = [p + torch.randint(0, 10000, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g).tolist()
               for p in prefixes for _ in range(per_prefix)]
    alone = [torch.randint(0, 10000, (int(torch.randint(100, 300, (1,), generator=g)),), generator=g).tolist()
             for _ in range(4)]
    order = torch.randperm(len(prompts) + len(alone), generator=g).tolist()
    return [(prompts + alone)[i] for i in order]


def _llm(backend: str, cascade: bool) -> LLM:
    skip_unless_runs(backend)
    llm = LLM(model=CKPT, attention_backend=backend, dtype="bfloat16", max_total_tokens=65536, cuda_graph_max_bs=64,
              log_level="warning", enable_cascade_attention=cascade)
    runner = llm.engine.runner
    assert (runner.cascade is not None) == cascade
    if cascade:  # every decode step with a group runs as cascade, however little it saves
        cascade = dataclasses.replace(runner.cascade, min_saved_tokens=0, min_saved_tokens_eager=0)
        runner.use_parts(dataclasses.replace(runner.parts, cascade=cascade))
    return llm


@requires_ckpt
@pytest.mark.parametrize("backend", ["fa,fi", "fi"])
def test_greedy_tokens_with_cascade_equal_without(backend):
    prompts = _shared_prompts()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    outs, steps = {}, {}
    for cascade in (False, True):
        llm = _llm(backend, cascade)
        try:
            outs[cascade] = llm.generate(prompts, params, use_tqdm=False)
            steps[cascade] = llm.engine.runner.num_cascade_steps
        finally:
            del llm
            free_cuda()
    assert steps[False] == 0 and steps[True] >= 20, f"cascade steps: {steps}"
    assert all(len(on.token_ids) == len(off.token_ids) == 32 for off, on in zip(outs[False], outs[True]))
    assert_same_up_to_ties(outs[False], outs[True], backend)
    print(f"\n{backend}: {steps[True]} cascade decode steps")


@requires_ckpt
def test_cascade_steps_never_synchronise():
    llm = _llm("fa,fi", True)
    eng = llm.engine
    try:
        assert eng.overlap
        reqs = start_decoding(eng, _shared_prompts(seed=1),
                              SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True))
        before = eng.runner.num_cascade_steps
        syncs = stream_syncs(lambda step=eng.step: [step() for _ in range(8)])
        assert eng.runner.num_cascade_steps - before == 8, "the steps checked should all run as cascade"
        assert not syncs, "cascade decode steps synchronised the stream at:\n" + "\n".join(syncs)
        for r in reqs:
            eng.abort(r.rid)
    finally:
        del llm, eng
        free_cuda()


def test_cascade_step_on_tensor_core_decode():
    """GQA 4 (32 q heads, 8 kv heads), which FlashInfer decodes on tensor cores (last in this file: its kernels are
    those tests/gpu/test_backends.py builds, minutes if they were not carried)."""
    test_cascade_step_matches_plain_fi_and_torch(16, hq=32, hkv=8, d=128)
