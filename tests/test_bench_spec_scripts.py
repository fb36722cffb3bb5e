"""The benchmark scripts of speculative decoding: the replay proposer of scripts/bench_spec_replay.py drafts exactly
the recorded continuation at acceptance 1 (so the engine keeps every draft and writes the recorded outputs) and
never a recorded token at acceptance 0; the code-edit workload's copy measure of scripts/offline_workloads.py
against a brute-force count."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from .helpers import greedy, make_llm, make_prompts, vocab_of

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


replay = load_script("bench_spec_replay")


def test_replay_proposer_drafts_the_recorded_continuation_or_other_tokens():
    prompt, out = (5, 6, 7), [10, 11, 12, 13, 14, 15]
    exact = replay.ReplayProposer({prompt: out}, vocab=50, acceptance=1.0)
    assert exact.propose("a", [5, 6, 7, 10, 11], 3) == [12, 13, 14]
    assert exact.propose("a", [5, 6, 7, 10, 11, 12, 13, 14], 3) == [15]  # the record ends there
    assert exact.propose("b", [9, 9, 9], 3) == []  # a prompt that was not recorded
    wrong = replay.ReplayProposer({prompt: out}, vocab=50, acceptance=0.0)
    for done in range(len(out)):
        draft = wrong.propose("a", list(prompt) + out[:done], 4)
        assert len(draft) == len(out[done:done + 4])
        assert all(d != t and 0 <= d < 50 for d, t in zip(draft, out[done:]))


@pytest.mark.parametrize("acceptance", [1.0, 0.0])
def test_replayed_drafts_give_the_recorded_outputs_at_the_set_acceptance(tiny_model, acceptance):
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), lens=[7, 19, 12])
    plain = make_llm(path).generate(prompts, greedy(24), use_tqdm=False)
    recorded = [list(o.token_ids) for o in plain]
    llm = make_llm(path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    outs, _, counters = replay.replay_run(llm, prompts, recorded, acceptance)
    assert outs == recorded
    assert counters["spec_verify_steps"] > 0 and counters["spec_draft_tokens"] > 0
    fig = replay.speculation_figures(counters)
    assert fig["acceptance_rate"] == acceptance
    if acceptance == 1.0:  # every draft kept: 4 drafts + the target's token a step, short only at the end
        assert fig["mean_accepted_length"] > 4
    else:
        assert fig["mean_accepted_length"] == 1.0


def test_copied_fraction_counts_output_tokens_inside_prompt_ngrams():
    workloads = load_script("offline_workloads")
    rng = random.Random(0)
    for _ in range(200):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        output = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        n = rng.randrange(1, 5)
        inside = set()
        for i in range(len(output) - n + 1):
            if any(output[i:i + n] == prompt[j:j + n] for j in range(len(prompt) - n + 1)):
                inside.update(range(i, i + n))
        expected = len(inside) / len(output) if len(output) >= n else 0.0
        assert workloads.copied_fraction(prompt, output, n) == pytest.approx(expected)


def test_copied_in_order_fraction_counts_a_loop_once():
    workloads = load_script("offline_workloads")
    prompt = [9, 1, 2, 3, 4, 5, 9]
    assert workloads.copied_in_order_fraction(prompt, [1, 2, 3, 4, 5]) == 1.0
    assert workloads.copied_in_order_fraction(prompt, [1, 2, 3] * 4) == pytest.approx(3 / 12)
    assert workloads.copied_in_order_fraction(prompt, [7, 1, 2, 8, 4, 5]) == pytest.approx(4 / 6)


def test_code_edit_sources_are_fixed_and_of_the_asked_length():
    workloads = load_script("offline_workloads")
    chosen = workloads.code_edit_sources(6)
    assert chosen == workloads.code_edit_sources(6)
    assert len({path for path, _ in chosen}) == 6
    assert all(path.startswith("torch/") and 60 <= text.count("\n") <= 150 for path, text in chosen)
