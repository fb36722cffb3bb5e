"""The CPU decode steps' thread count (kernels/cpu_threads.py) against step times drawn from a machine model: a
quiet one (all threads fastest), a loaded one (all threads stall at every barrier), and one whose load comes and
goes; the reference is the best fixed choice in hindsight. And an engine run leaves torch's thread count as it was."""
from __future__ import annotations

import random

import torch

from minisrv.kernels.cpu_threads import ThreadTuner

from .helpers.tiny_models import build_tiny_model, greedy, make_llm, make_prompts, vocab_of

QUIET = {2: 0.010, 1: 0.018}  # seconds a step, by thread count
LOADED = {2: 1.5, 1: 0.025}


def _run(tuner: ThreadTuner, machine, steps: int, seed: int = 0):
    """(seconds in all, steps on each count); machine(step) -> {threads: seconds}, each time jittered by 20%."""
    rng = random.Random(seed)
    total, used = 0.0, {}
    for i in range(steps):
        threads = tuner.pick()
        seconds = machine(i)[threads] * rng.uniform(0.9, 1.1)
        tuner.record(1, threads, seconds)
        total += seconds
        used[threads] = used.get(threads, 0) + 1
    return total, used


def test_quiet_machine_keeps_every_thread():
    tuner = ThreadTuner(2)
    total, used = _run(tuner, lambda i: QUIET, 2000)
    assert tuner.current == 2
    assert total <= 1.01 * 2000 * QUIET[2]  # the tries of one thread cost at most 1%


def test_loaded_machine_drops_to_one_thread_and_rarely_tries_more():
    tuner = ThreadTuner(2)
    total, used = _run(tuner, lambda i: LOADED, 2000)
    assert tuner.current == 1
    assert total <= 1.25 * 2000 * LOADED[1]  # the first steps and the tries of two threads: at most a quarter more


def test_load_that_comes_and_goes_is_followed():
    tuner = ThreadTuner(2)
    phases = [QUIET, LOADED, QUIET]
    total, _ = _run(tuner, lambda i: phases[min(i // 1000, 2)], 3000)
    best = 1000 * (QUIET[2] + LOADED[1] + QUIET[2])
    assert total <= 1.6 * best  # (the loaded phase's tries are what cost: each is sixty steps' worth)
    assert tuner.current == 2


def test_one_core_has_nothing_to_choose():
    tuner = ThreadTuner(1)
    assert {tuner.pick() for _ in range(50)} == {1}


def test_engine_steps_leave_torch_threads_as_they_were(tmp_path):
    hf = build_tiny_model(str(tmp_path / "hf"), "llama")
    before = torch.get_num_threads()
    llm = make_llm(hf)
    try:
        runner = llm.engine.runner
        assert runner.threads is not None and runner.threads.counts[0] == before
        out = llm.generate(make_prompts(vocab_of(hf), [5, 9]), greedy(12), use_tqdm=False)
        assert all(len(o.token_ids) == 12 for o in out)
        assert torch.get_num_threads() == before
        assert runner.threads.mean  # decode steps were timed
    finally:
        llm.close()
