#!/usr/bin/env python
"""Host-side cost of the engine loop, measured on a CPU with the model taken out.

What it measures: everything `LLM.generate` does on the host for the GPU `prefix` workload of
scripts/bench_offline.py (8 prefixes of 4,096 random tokens, 32 requests on each with a 16-256 token suffix,
32-128 output tokens, temperature 0.6, page size 16; 256 requests), with the prefix cache on and off: request
checks, scheduling, the radix tree, page and table bookkeeping, building step tensors, collecting tokens,
detokenisation. On a GPU these run while (or instead of) the device works, so they bound how fast a step can be
whatever the model; none of them depends on the device, so they can be measured here.

How: the engine runs a Qwen3-shaped checkpoint of one layer (hidden 64) with the default model's tokenizer (a real
BPE tokenizer, so detokenisation costs what it does in production), and its runner's `forward_logits` is replaced by
a stub that returns random logits over the first `--stub-vocab` token ids: no attention plan, no layers. The stub's
time and the sampler's (tensor work a GPU would do) are subtracted from each step's time; what is left is the host
time per step, reported by kind (extend / decode). Per-call costs of the per-request host work (request check,
prefix match, tree insert) are timed in place. Times are the engine thread's CPU time (torch kept to that thread),
so other processes on a shared machine do not inflate them, and each figure is the median over `--repeat` runs of
the workload, the prefix cache emptied before each. `--profile` adds a cProfile of one run (its overhead inflates
Python code, so its numbers are shares, not timings).

  python scripts/bench_host.py                 # cache on and off, per-step and per-call host costs
  python scripts/bench_host.py --profile --no-cache-off --top 30
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench_offline  # noqa: E402  (the workload itself, so both benchmarks run the same requests)


def build_checkpoint(path: str) -> str:
    """A one-layer Qwen3-shaped checkpoint (hidden 64) whose vocabulary is the default model's tokenizer's."""
    import transformers
    from minisrv.checkpoints.loader import default_model_path, load_tokenizer
    tok = load_tokenizer(default_model_path())
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=40960, tie_word_embeddings=True,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def clock() -> float:
    """This thread's CPU time: unlike wall time it does not grow while other processes hold the cores, so runs on a
    shared machine agree (torch runs on this thread too, see main). On an idle machine the two are the same."""
    return time.thread_time()


class Timer:
    """Wraps obj.name so each call's count and seconds are recorded (the wrapper itself costs well under 1 us)."""

    def __init__(self, obj: object, name: str) -> None:
        self.calls, self.seconds = 0, 0.0
        fn: Callable = getattr(obj, name)
        self._undo = (obj, name, fn)

        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - t
                self.calls += 1

        setattr(obj, name, timed)

    def restore(self) -> None:
        """Put the wrapped function back (the next run's timers must not wrap this one's)."""
        obj, name, fn = self._undo
        setattr(obj, name, fn)

    def us_per_call(self) -> float:
        return 1e6 * self.seconds / max(1, self.calls)


def run(path: str, cache: bool, a: argparse.Namespace, profile: bool) -> List[Dict[str, object]]:
    """`--repeat` generate calls of the workload on one engine (its prefix cache emptied before each); one summary
    each."""
    from minisrv.engine import engine as engine_mod
    from minisrv.engine import model_runner as runner_mod
    from minisrv.engine.request import SamplingParams
    from minisrv.llm import LLM

    llm = LLM(model=path, device="cpu", attention_backend="torch", dtype="float32", page_size=a.page_size,
              max_total_tokens=a.max_total_tokens, disable_radix_cache=not cache, log_level="warning")
    eng = llm.engine
    width = min(a.stub_vocab, eng.parts.args.vocab_size)

    def stub_forward(fb):
        return torch.randn(fb.batch_size, width)

    eng.runner.forward_logits = stub_forward
    if a.workload == "nano":
        prompts, params = bench_offline.nano_workload(256, (100, 1024), (100, 1024))
    else:
        prompts, params = bench_offline.prefix_workload(a.num_prefixes, a.prefix_len, a.per_prefix,
                                                        (a.min_output_len, a.max_output_len))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    steps: List[Tuple[str, float]] = []
    kinds: List[str] = []
    launch, step = eng.runner.launch, eng.step

    def launch_and_note(batch, *args, **kwargs):
        kinds.append(batch.mode.value)
        return launch(batch, *args, **kwargs)

    def timed_step():
        before = fwd.seconds + smp.seconds
        t = clock()
        out = step()
        spent = clock() - t
        steps.append((kinds.pop() if kinds else "idle", spent - (fwd.seconds + smp.seconds - before)))
        return out

    eng.runner.launch = launch_and_note
    eng.step = timed_step
    fwd = Timer(eng.runner, "forward_logits")
    smp = Timer(runner_mod, "sample")
    timers = {"check_request": Timer(engine_mod, "check_request")}
    if eng.cache is not None:
        timers.update(match_prefix=Timer(eng.cache, "match_prefix"), insert=Timer(eng.cache, "insert"))
    results = []
    for i in range(a.repeat):
        eng.flush_cache()
        for tm in (fwd, smp, *timers.values()):
            tm.calls, tm.seconds = 0, 0.0
        steps.clear()
        eng.num_cached_prompt_tokens = 0
        prof = cProfile.Profile() if profile and i == 0 else None
        t = clock()
        if prof is not None:
            prof.enable()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if prof is not None:
            prof.disable()
        total = clock() - t
        by_kind: Dict[str, List[float]] = {}
        for kind, s in steps:
            by_kind.setdefault(kind, []).append(s)
        results.append({
            "cache": cache, "total": total, "standin": fwd.seconds + smp.seconds,
            "steps": sum(s for _, s in steps), "by_kind": by_kind,
            "calls": {k: (v.calls, v.us_per_call()) for k, v in timers.items()},
            "out_tokens": sum(len(o.token_ids) for o in outs), "hit": eng.num_cached_prompt_tokens,
            "in_tokens": sum(len(p) for p in prompts), "prof": prof,
        })
    for tm in (fwd, smp, *timers.values()):
        tm.restore()
    return results


def report(results: List[Dict[str, object]], top: int) -> None:
    """Each figure is the median over the repeats (other processes on the machine add noise to single runs)."""
    med = statistics.median
    r0 = results[0]
    print(f"prefix cache {'on' if r0['cache'] else 'off'} ({r0['out_tokens']} output tokens, hit rate "
          f"{r0['hit'] / r0['in_tokens']:.1%}), thread CPU time, medians of {len(results)} runs: generate "
          f"{med(r['total'] for r in results):.3f} s in all, of which stub forward + sampler "
          f"{med(r['standin'] for r in results):.3f} s; host time in steps {med(r['steps'] for r in results):.3f} s, "
          f"outside steps (request checks, queueing) "
          f"{med(r['total'] - r['standin'] - r['steps'] for r in results):.3f} s")
    print("  runs (s): " + ", ".join(f"{r['total']:.3f}" for r in results))
    for kind in sorted(r0["by_kind"]):
        per_step = [r["by_kind"][kind] for r in results]
        print(f"  {kind:6s} steps {len(per_step[0]):5d}: host per step median "
              f"{med(1e6 * med(ts) for ts in per_step):8.0f} us, mean "
              f"{med(1e6 * statistics.fmean(ts) for ts in per_step):8.0f} us, "
              f"total {med(sum(ts) for ts in per_step):6.3f} s")
    for name, (n, _) in r0["calls"].items():
        print(f"  {name:14s} {n:5d} calls, {med(r['calls'][name][1] for r in results):8.1f} us each")
    if r0["prof"] is not None:
        st = pstats.Stats(r0["prof"])
        st.sort_stats("tottime").print_stats(top)
        st.sort_stats("cumulative").print_stats(top)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory to use instead of the one-layer one built here")
    p.add_argument("--workload", choices=("prefix", "nano"), default="prefix",
                   help="prefix: the GPU prefix workload (below); nano: the nano workload (256 requests of 100-1024 "
                        "prompt and output tokens: 256-row decode steps)")
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--per-prefix", type=int, default=32)
    p.add_argument("--min-output-len", type=int, default=32)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=600_000,
                   help="KV pool size in tokens (about what a Qwen3-0.6B leaves on an H100)")
    p.add_argument("--stub-vocab", type=int, default=256,
                   help="the stub's logits cover the first this many ids (a small sampler, standing in for a GPU's)")
    p.add_argument("--repeat", type=int, default=3, help="runs per setting (figures are medians)")
    p.add_argument("--no-cache-off", action="store_true", help="only the run with the prefix cache on")
    p.add_argument("--profile", action="store_true", help="cProfile the first run with the prefix cache on")
    p.add_argument("--top", type=int, default=25, help="functions listed in the profile")
    a = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # the host side is one thread; torch's pool would only contend with other processes
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model or build_checkpoint(tmp)
        report(run(path, True, a, a.profile), a.top)
        if not a.no_cache_off:
            report(run(path, False, a, False), a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
