#!/usr/bin/env python
"""The cost of speculative decoding's verify path at a set acceptance, on random weights (whose drafts could not be
predicted by any real proposer).

First a plain greedy run (no speculation) of --batch-sizes requests at a time, each a prompt of --input-len random
tokens and exactly --output-len output tokens (ignore_eos), records every request's output ids and times each batch
size: the baseline. It runs in a process of its own, so that its GPU memory is given back before the second engine
starts. Then an engine with speculation on (NGRAM's settings, --num-draft-tokens positions scored per request per
verify step: the request's last token and up to N-1 drafts) runs the same requests with its proposer replaced by a
replay proposer: it drafts what the recorded run wrote next, each token replaced by a different random one with
probability 1 - acceptance (seeded: the same drafts every run). For each --acceptance and batch size it reports
output tok/s without and with speculation, their ratio, the measured acceptance rate (accepted / drafted tokens)
and mean accepted length (tokens a request gains per verify step, the target's next token included), the verify
steps, and how many requests wrote exactly their recorded output (greedy speculation writes what plain decoding
does; a difference can only come from kernels whose rounding differs between the verify and the decode shapes).
A draft is kept only up to its first replaced token, so below 1 the measured rate is under the set one: with 4
drafts, (a + a^2 + a^3 + a^4) / 4 of them are kept at a set rate a (0.44 at 0.7), before the back-off's effect.

The engine's own fallback applies: above --speculative-disable-by-batch-size running requests no step drafts (pass
a larger value to price verifying there), and a request whose drafts keep missing backs off. Every timed run is
preceded by an untimed one of the same requests with 8 output tokens, and the prefix cache is emptied before each
run, so that no run reuses another's prompts.

  python scripts/bench_spec_replay.py --model /tmp/llama8b --batch-sizes 1,8,32,64 --acceptance 1.0,0.7,0.0
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from minisrv.config import EngineConfig  # noqa: E402
from minisrv.engine.request import SamplingParams  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import speculation_counters, speculation_figures  # noqa: E402


class ReplayProposer:
    """Drafts what a recorded run wrote after the same history: the recorded output from the current position on,
    each token replaced by a different random one with probability 1 - acceptance. A request is found by its prompt
    (the first time its key is seen); one whose prompt was not recorded gets no draft."""

    def __init__(self, recorded: Dict[Tuple[int, ...], Sequence[int]], vocab: int, acceptance: float,
                 seed: int = 0) -> None:
        self.recorded = recorded
        self.prompt_lens = sorted({len(p) for p in recorded})
        self.vocab, self.acceptance = vocab, acceptance
        self.rng = random.Random(seed)
        self._runs: Dict[str, Tuple[int, Sequence[int]]] = {}  # key -> (prompt length, recorded output)

    def _run_of(self, key: str, tokens: Sequence[int]):
        run = self._runs.get(key)
        if run is None:
            for n in self.prompt_lens:
                out = self.recorded.get(tuple(tokens[:n]))
                if out is not None:
                    run = self._runs[key] = (n, out)
                    break
        return run

    def propose(self, key: str, tokens: Sequence[int], num_draft: int) -> List[int]:
        run = self._run_of(key, tokens)
        if run is None:
            return []
        prompt_len, out = run
        done = len(tokens) - prompt_len
        rng = self.rng
        return [t if rng.random() < self.acceptance else (t + 1 + rng.randrange(self.vocab - 1)) % self.vocab
                for t in out[done:done + num_draft]]

    def release(self, key: str, tokens: Sequence[int]) -> None:
        self._runs.pop(key, None)


def make_prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 10000)) for _ in range(input_len)] for _ in range(n)]


def timed_generate(llm, prompts: List[List[int]], output_len: int):
    """(output ids of each request, seconds, the engine's speculative counters over the run): one untimed run of
    the same prompts with 8 output tokens first, the prefix cache emptied before each."""
    eng = llm.engine
    for max_tokens in (8, output_len):
        eng.flush_cache()
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        before = eng.stats()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
    return [list(o.token_ids) for o in outs], dt, speculation_counters(before, eng.stats())


def replay_run(llm, prompts: List[List[int]], recorded: List[List[int]], acceptance: float, seed: int = 0):
    """The speculative engine `llm` on `prompts` with drafts replayed from `recorded` (their plain greedy outputs)
    at `acceptance`: (outputs, seconds, counters) as timed_generate gives them."""
    vocab = llm.engine.parts.args.vocab_size
    llm.engine.speculator.proposer = ReplayProposer({tuple(p): o for p, o in zip(prompts, recorded)}, vocab,
                                                    acceptance, seed)
    return timed_generate(llm, prompts, len(recorded[0]))


def engine_kwargs(a: argparse.Namespace, speculative: bool) -> dict:
    kw = vars(EngineConfig.from_args(a))
    if speculative:
        kw.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=a.num_draft_tokens)
    else:
        kw.update(speculative_algorithm=None)
    return kw


def plain_phase(a: argparse.Namespace, batch_sizes: List[int]) -> dict:
    """Each batch size's baseline: its prompts' recorded outputs and seconds."""
    from minisrv.llm import LLM
    llm = LLM(**engine_kwargs(a, speculative=False))
    prompts = make_prompts(max(batch_sizes), a.input_len, llm.engine.parts.args.vocab_size, a.replay_seed)
    runs = {}
    for bs in batch_sizes:
        outs, dt, _ = timed_generate(llm, prompts[:bs], a.output_len)
        runs[str(bs)] = {"outputs": outs, "time_s": dt}
    llm.close()
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_args(p)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--acceptance", default="1.0,0.7,0.0",
                   help="the replayed drafts' per-token acceptance (1 - the chance a token is replaced)")
    p.add_argument("--num-draft-tokens", type=int, default=5,
                   help="positions a verify step scores per request: its last token and up to N-1 drafts")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--replay-seed", type=int, default=0, help="the prompts' and the corruption's seed")
    p.add_argument("--json", help="append one JSON line per (acceptance, batch size) to this file")
    p.add_argument("--plain-phase-to", help=argparse.SUPPRESS)  # the baseline's process writes its runs here
    a = p.parse_args()
    if a.log_level == EngineConfig.log_level:
        a.log_level = "warning"
    batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    if a.plain_phase_to:
        with open(a.plain_phase_to, "w") as f:
            json.dump(plain_phase(a, batch_sizes), f)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plain.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--plain-phase-to", path],
                       check=True)
        with open(path) as f:
            plain = json.load(f)

    from minisrv.llm import LLM
    llm = LLM(**engine_kwargs(a, speculative=True))
    eng = llm.engine
    prompts = make_prompts(max(batch_sizes), a.input_len, eng.parts.args.vocab_size, a.replay_seed)
    cuda = torch.cuda.is_available() and eng.parts.device.type == "cuda"
    common = {"model": eng.parts.model_path, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "dtype": str(eng.parts.dtype).replace("torch.", ""), "backend": eng.parts.backend_name,
              "input_len": a.input_len, "output_len": a.output_len, "num_draft_tokens": a.num_draft_tokens,
              "disable_by_batch_size": eng.speculator.disable_by_batch_size}
    print(f"{common['model']} [{common['backend']}, {common['dtype']}, {common['device']}]: {a.input_len} prompt "
          f"tokens, {a.output_len} output tokens a request, {a.num_draft_tokens} positions a verify step "
          f"(drafting only while <= {common['disable_by_batch_size']} requests run)")
    print(f"{'accept':>6} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'measured':>8} "
          f"{'mean len':>8} {'verifies':>8} {'as recorded':>11}")
    for acceptance in [float(x) for x in a.acceptance.split(",")]:
        for bs in batch_sizes:
            recorded = plain[str(bs)]["outputs"]
            outs, dt, counters = replay_run(llm, prompts[:bs], recorded, acceptance, a.replay_seed)
            tokens = sum(len(o) for o in outs)
            plain_tok_s = sum(len(o) for o in recorded) / plain[str(bs)]["time_s"]
            fig = speculation_figures(counters)
            row = {**common, "acceptance_set": acceptance, "batch_size": bs, "plain_tok_s": round(plain_tok_s, 1),
                   "spec_tok_s": round(tokens / dt, 1), "ratio": round(tokens / dt / plain_tok_s, 3), **fig,
                   **counters, "as_recorded": sum(o == r for o, r in zip(outs, recorded))}
            print(f"{acceptance:6.2f} {bs:5d} {row['plain_tok_s']:11.1f} {row['spec_tok_s']:10.1f} "
                  f"{row['ratio']:6.3f} {fig['acceptance_rate'] if fig['acceptance_rate'] is not None else '-':>8} "
                  f"{fig['mean_accepted_length'] or '-':>8} {counters['spec_verify_steps']:8d} "
                  f"{row['as_recorded']:>7d}/{bs}", flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
