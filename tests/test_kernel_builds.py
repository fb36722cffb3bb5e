"""Kernels built in the background (engine/kernel_builds.py): the builds run side by side and a failed one counts as
done; an engine that started on its stand-in kernels switches between two steps, once they are built, and its
greedy tokens are those of an engine that ran on the final kernels throughout. On the CPU the final layer ops are the
compiled CPU ops and the stand-ins torch's, as on a GPU FlashInfer's and torch's."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from minisrv.engine.kernel_builds import KernelBuilds, StagedKernels
from minisrv.engine.request import SamplingParams
from minisrv.engine.setup import staged_backend
from minisrv.models.attention_options import SINKS, SOFTCAP, WINDOW

from .helpers.tiny_models import greedy, make_llm, make_prompts, vocab_of


def test_builds_run_side_by_side_and_a_failure_counts_as_done(caplog):
    both_running = threading.Barrier(2, timeout=10)  # breaks (and fails the job) unless the two run at once
    gate = threading.Event()
    ran = []

    def fails():
        raise RuntimeError("nvcc not found")

    builds = KernelBuilds({"a": lambda: ran.append(both_running.wait()), "b": lambda: ran.append(both_running.wait()),
                           "slow": gate.wait, "bad": fails})
    with caplog.at_level(logging.WARNING, logger="minisrv"):
        assert builds.wait(["a", "b", "bad"], timeout=10)
    assert sorted(ran) == [0, 1]  # both passed the barrier: they ran side by side
    assert "building the bad kernels in the background failed" in caplog.text
    assert builds.pending() == ["slow"] and not builds.done()
    assert not builds.wait(timeout=0.05)
    gate.set()
    assert builds.wait(timeout=10) and builds.done() and builds.pending() == []
    assert all(name in builds.report() for name in ("a", "b", "slow", "bad"))


def test_staged_backend_stands_fa_in_for_fi_where_fa_runs(monkeypatch):
    cpu = torch.device("cpu")
    assert staged_backend("fa,fi", cpu) == "fa,torch"  # no FA3 here: torch's attention stands in
    assert staged_backend("fi", cpu) == "torch"
    assert staged_backend("fa", cpu) == "fa"
    import minisrv.attention as registry
    monkeypatch.setitem(registry.BACKENDS, "fa", (lambda sm: None, *registry.BACKENDS["fa"][1:]))  # as on Hopper
    assert staged_backend("fa,fi", cpu) == "fa"
    assert staged_backend("fi", cpu) == "fa"
    # a soft-capped model (Gemma 2) is not served by fa: torch stands in for fi; windows and sinks are
    assert staged_backend("fi", cpu, frozenset({WINDOW, SOFTCAP})) == "torch"
    assert staged_backend("fi", cpu, frozenset({WINDOW, SINKS})) == "fa"


def _run(engine, prompts, params, release=None, release_after=3):
    """Step the engine until every request ends, polling for built kernels before each step as the engine loop
    does; `release` is called once each request has `release_after` tokens. Returns each request's output tokens."""
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens = {r.rid: [] for r in reqs}
    while engine.has_work():
        for out in engine.switch_kernels() + engine.step():
            assert out.error is None, out.error
            tokens[out.rid] += out.new_token_ids
        if release is not None and min(len(t) for t in tokens.values()) >= release_after:
            release()
            release = None
    return [tokens[r.rid] for r in reqs]


def test_engine_switches_to_built_kernels_between_steps_with_the_same_tokens(tiny_model):
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [5, 17, 9])
    reference = make_llm(path)
    final_ops = reference.engine.runner.model.ops.kernels
    if final_ops is None:
        pytest.skip("the compiled CPU ops did not build here: no final kernels to switch to")
    want = _run(reference.engine, prompts, [greedy(12)] * 3)

    staged_llm = make_llm(path)
    engine = staged_llm.engine
    model = engine.runner.model
    model.ops.use(None)  # started before its kernels were built
    gate = threading.Event()
    switched, drawn = [], []

    def fake_sampling(scaled: torch.Tensor) -> torch.Tensor:  # the fused draw: greedy here, so tokens are comparable
        drawn.append(scaled.shape[0])
        return scaled.argmax(-1)

    builds = KernelBuilds({"norm": gate.wait, "sampling": lambda: None})
    engine.staged_kernels = StagedKernels(builds, model.ops, final_ops, lambda parts: switched.append(parts) or parts,
                                          "torch", lambda: fake_sampling, "torch's ops")

    def release():
        assert model.ops.kernels is None  # still the stand-ins after several steps
        assert not switched
        gate.set()
        builds.wait(timeout=10)

    sampled = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
    got = _run(engine, prompts + [prompts[0]], [greedy(12)] * 3 + [sampled], release)
    assert got[:3] == want
    assert engine.staged_kernels is None  # everything switched
    assert model.ops.kernels is final_ops
    assert len(switched) == 1  # attention switched once, with the layers
    assert engine.runner.sampling_kernel is fake_sampling and drawn  # the unseeded sampled request used it
    assert len(got[3]) == 12


def test_graphs_only_wait_for_an_idle_moment_or_their_due_time(tiny_model):
    """A server whose kernels are all built captures its CUDA graphs later (graphs_only): not before its first step
    nor between the steps of its first requests, but when the engine reports a pause after a step
    (switch_kernels(idle=True)), after a long pause without any request, or between two steps once GRAPHS_DUE_S
    have passed since the first. The tokens are those of an engine that never waited."""
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [5, 9])
    want = _run(make_llm(path).engine, prompts, [greedy(6)] * 2)
    engine = make_llm(path).engine
    switched = []

    def staged():
        model = engine.runner.model
        return StagedKernels(KernelBuilds({"norm": lambda: None}), model.ops, model.ops.kernels,
                             lambda parts: switched.append(parts) or parts, "torch", lambda: None, "attention torch",
                             graphs_only=True)

    engine.staged_kernels = staged()
    engine.staged_kernels.builds.wait(timeout=10)
    engine.switch_kernels(idle=True)  # idle before any step (the HTTP side may still be starting): not yet
    assert not switched
    assert _run(engine, prompts, [greedy(6)] * 2) == want
    assert not switched and engine.staged_kernels is not None  # busy, not yet due: no capture between steps
    assert engine.switch_kernels() == [] and not switched
    engine.switch_kernels(idle=True)
    assert len(switched) == 1 and engine.staged_kernels is None

    engine.staged_kernels = staged()  # never a request: idle long enough, they are captured all the same
    engine.staged_kernels.builds.wait(timeout=10)
    engine.staged_kernels.started_serving -= StagedKernels.IDLE_BEFORE_ANY_STEP_S
    engine.switch_kernels(idle=True)
    assert len(switched) == 2 and engine.staged_kernels is None

    engine.staged_kernels = staged()
    engine.staged_kernels.builds.wait(timeout=10)
    engine.staged_kernels.GRAPHS_DUE_S = 0.0  # due as soon as the first step runs
    assert _run(engine, prompts, [greedy(6)] * 2) == want
    assert len(switched) == 3 and engine.staged_kernels is None


def test_a_failed_switch_leaves_the_stand_ins_serving(tiny_model, caplog):
    """The switch itself fails (say, graph capture runs out of memory): the error is logged, the layers keep
    torch's ops, and the engine goes on generating the same greedy tokens."""
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [6, 11])
    llm = make_llm(path)
    want = _run(llm.engine, prompts, [greedy(8)] * 2)
    engine = llm.engine
    model = engine.runner.model
    final_ops = model.ops.kernels
    model.ops.use(None)
    parts = engine.runner.parts

    def failing_switch(current):
        raise RuntimeError("CUDA out of memory while capturing")

    engine.staged_kernels = StagedKernels(KernelBuilds({"norm": lambda: None}), model.ops, final_ops, failing_switch,
                                          "torch", lambda: None, "torch's ops")
    with caplog.at_level(logging.ERROR, logger="minisrv"):
        got = _run(engine, prompts, [greedy(8)] * 2)
    assert got == want
    assert "the switch to FlashInfer's kernels failed" in caplog.text
    assert engine.staged_kernels is None and model.ops.kernels is None and engine.runner.parts == parts


def test_a_flashinfer_without_the_expected_getters_means_no_builds(monkeypatch, caplog):
    """FlashInfer's module getters are internal: where a version lacks one, the engine starts without background
    builds (each module built on first use) instead of failing."""
    from minisrv.config import EngineConfig
    from minisrv.engine import setup
    from minisrv.models.args import ModelArgs

    ops = object()
    monkeypatch.setattr(setup, "fused_ops_for", lambda device: ops)

    def missing_getter(*a, **k):
        raise ImportError("cannot import name 'get_rope_module'")

    monkeypatch.setattr(setup, "flashinfer_jobs", missing_getter)
    args = ModelArgs.__new__(ModelArgs)
    args.num_heads, args.num_kv_heads, args.head_dim = 16, 8, 128
    with caplog.at_level(logging.WARNING, logger="minisrv"):
        fused, builds = setup._fused_and_builds(EngineConfig(), args, "fa,fi", torch.bfloat16, torch.device("cpu"))
    assert fused is ops and builds is None
    assert "built on first use" in caplog.text and "get_rope_module" in caplog.text
