#!/usr/bin/env python
"""Offline throughput benchmark.

Workloads (`--workload`):
  nano  nano-vLLM's / mini-SGLang's benchmark: random.seed(0); 256 requests; for each, in order, a prompt of
        randint(100, 1024) tokens, each randint(0, 10000); then for each request max_tokens = randint(100, 1024);
        temperature 0.6, ignore_eos (133,966 output tokens). The default on a GPU.
  cpu   32 prompts of randint(64, 256) random tokens, 64 output tokens each, greedy, ignore_eos; with --hf (the
        default for this workload) it also times HF transformers' single-stream `generate` on the same model,
        prompts and dtype. The default on a CPU.
  shared  requests that share long prefixes, as chat traffic with system prompts does: random.seed(0); 8 system
        prompts of randint(800, 1200) tokens; 256 requests, request i = system prompt i % 8 followed by
        randint(20, 200) tokens; max_tokens randint(50, 300); temperature 0.6, ignore_eos, in random order. The
        prefix cache's hit rate (prompt tokens served from it / prompt tokens) is printed.
  prefix  the prefix-cache benchmark: random.seed(0); P shared prefixes of L random tokens (8 x 4096 on a GPU,
        2 x 512 on a CPU), R requests on each (32; 8 on a CPU) with a random suffix of 16-256 tokens, output
        randint(32, 128) tokens (16 on a CPU; --max-output-len raises the top), temperature 0.6, ignore_eos, the
        requests shuffled with a fixed seed.
  code-edit  a source file and an instruction to rewrite it whole with one small change (rename its first function
        or class, or add a line to its docstring), so that the answer mostly copies the prompt, as agents that edit
        files do: --num-prompts (4) Python files of 60-150 lines of the installed torch package (in their paths' hash
        order; scripts/train_eagle3.py asks about later ones), each in a chat-templated prompt followed by the
        answer's start (a code fence and the file's first three lines); greedy, up to --max-output-len (1024)
        tokens, ended by the model's end of turn. Meant for a real model (the default one on a CPU). Printed: the
        share of output tokens inside an 8-gram that also occurs in the prompt (what drafting from the context can
        propose, a loop over one line included) and the share copied from the prompt in order (difflib's alignment:
        a small model's answer often falls into a loop).
One warm-up generate first; the clock covers one `generate` call, or with --sequential one call a request (the clock
over all of them: single-stream speed). With speculative decoding on (--speculative-algorithm), the output line adds
the drafts' acceptance rate (accepted / drafted tokens) and the mean accepted length (tokens a request gains per
verify step, the target's own next token included) over the timed run.

`--json-schema [SCHEMA]` generates every request of the workload under a JSON schema (SamplingParams.json_schema;
without a value, BENCH_SCHEMA: one object with one string field), to price structured outputs: each step fills
the constrained rows' token masks on the host and gives up overlap scheduling. The workloads set ignore_eos, but
a grammar that is complete still ends its request (only a stop token is then allowed), so a constrained run may
make fewer output tokens than the same workload unconstrained: the printout gives the mean output length and how
many requests the grammar ended. So that the price is read off one run, the same prompts are then generated again
without the grammar, each request stopped at the length its constrained run reached (the prefix cache emptied
between the two), and both speeds are printed.

  python scripts/bench_offline.py                                  # default model, CPU workload, HF baseline
  python scripts/bench_offline.py --model /tmp/qwen3 --attention-backend fa,fi   # on a GPU: the nano workload
  python scripts/bench_offline.py --json-schema                    # the same workload, every request constrained
  python scripts/bench_offline.py --workload code-edit --sequential --speculative-algorithm NGRAM
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from minisrv.config import EngineConfig  # noqa: E402
from minisrv.engine.phase_timer import time_phases  # noqa: E402
from minisrv.engine.request import SamplingParams  # noqa: E402
from minisrv.utils import freeze_startup_heap  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_workloads import (code_edit_workload, copied_fraction, copied_in_order_fraction,  # noqa: E402
                               cpu_workload, nano_workload, prefix_workload, shared_workload)


# The schema of --json-schema without a value: a model writes `{"text": "` and then stays inside the string, where
# nearly every token is allowed, until it writes a quote; the object's grammar work is that of typical JSON output.
BENCH_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def hf_model(path: str, dtype: torch.dtype, device: torch.device):
    """HF transformers' model on the weights minisrv serves from `path` (a GGUF is dequantised by our loader)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from minisrv.checkpoints.gguf_file import iter_gguf
    from minisrv.checkpoints.loader import is_gguf, load_hf_config, load_model_args
    if not is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    cfg = load_hf_config(path)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("_name_or_path",)})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    state = dict(iter_gguf(path, load_model_args(path)))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m and "rotary" not in m]:
        raise RuntimeError(f"HF baseline: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    for m in model.modules():  # the rotary inv_freq buffer was left empty on the meta device: built afresh
        if hasattr(m, "inv_freq") and hasattr(m, "config"):
            with torch.device(device):
                fresh = type(m)(m.config)
            m.inv_freq, m.original_inv_freq = fresh.inv_freq, fresh.original_inv_freq
            m.attention_scaling = fresh.attention_scaling
    return model.to(dtype).eval()


@torch.inference_mode()
def hf_single_stream(model, prompts, out_len: int, device) -> float:
    """Output tok/s of HF generate, one prompt at a time, greedy, exactly out_len new tokens each."""
    warm = torch.tensor([prompts[0][:16]], device=device)
    model.generate(warm, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    t = time.perf_counter()
    total = 0
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        total += out.shape[1] - ids.shape[1]
    return total / (time.perf_counter() - t)


def trace_steps(eng):
    """Record (kind, batch size, seconds) for every engine step, where kind and size are those of the step
    launched in that call."""
    trace = []
    step, launch = eng.step, eng.runner.launch
    last = []

    def launch_and_note(batch, *args, **kwargs):
        last.append((batch.mode.value, len(batch.reqs)))
        return launch(batch, *args, **kwargs)

    def timed():
        t = time.perf_counter()
        out = step()
        if last:
            trace.append((*last.pop(), time.perf_counter() - t))
        return out

    eng.runner.launch = launch_and_note
    eng.step = timed
    return trace


def print_steps(trace) -> None:
    buckets = {}
    for kind, bs, dt in trace:
        key = (kind, 0) if kind == "extend" else (kind, next(b for b in (16, 64, 128, 192, 256, 1 << 30) if bs <= b))
        buckets.setdefault(key, []).append(dt)
    print("steps: kind, batch size up to, count, median ms, total s")
    for (kind, b), ts in sorted(buckets.items()):
        print(f"  {kind:6s} {b if kind == 'decode' else '':>6} {len(ts):6d} {1e3 * statistics.median(ts):8.2f} "
              f"{sum(ts):7.2f}")


SPEC_COUNTERS = ("spec_verify_steps", "spec_verified_requests", "spec_draft_tokens", "spec_accepted_tokens")


def speculation_counters(before, after):
    """The speculative counters of engine.stats() over a run: after - before."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}


def speculation_figures(counters):
    """The drafts' acceptance rate (accepted / drafted tokens) and the mean accepted length (tokens a request gained
    per verify step, the target's next token included); None where nothing was drafted or verified."""
    drafted, accepted, verified = (counters[k] for k in ("spec_draft_tokens", "spec_accepted_tokens",
                                                         "spec_verified_requests"))
    return {"acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_accepted_length": round((accepted + verified) / verified, 3) if verified else None}


def watch_window_pool(eng) -> List[int]:
    """Record the pages the running requests hold of both kinds (full, windowed) at the step where they hold the
    most full ones: a pool whose windowed layers keep only their window (kvcache/pool.py). (Pages only the prefix
    cache holds are left out: it gives them back under pressure.)"""
    peak, step = [0, 0], eng.step

    def watched_step():
        running = eng.scheduler.running
        full = sum(len(r.pages) for r in running)
        if full >= peak[0]:
            peak[:] = [full, sum(p is not None for r in running for p in r.window_pages)]
        return step()

    eng.step = watched_step
    return peak


def print_window_peak(eng, full: int, window: int) -> None:
    """The KV memory the peak's context took, per token of it, against every layer keeping every token."""
    pool = eng.parts.pool
    page_bytes = [kv.nbytes // kv.shape[1] for kv in pool.kv]  # a page of each layer ([2, pages, page, Hkv, D])
    held = sum(b * (window if i in pool.window_layers else full) for i, b in enumerate(page_bytes))
    tokens = max(full, 1) * pool.page_size
    print(f"KV at its peak: {tokens} tokens of context in {held / 2**30:.2f} GiB ({window * pool.page_size} "
          f"windowed tokens) = {held / tokens:.0f} bytes a token, {held / (sum(page_bytes) * max(full, 1)):.3f} of "
          f"every layer global")


def time_replicas(llm, prompts, params, t_ready: float) -> int:
    """The workload on LLM(dp_size > 1): one warm-up request a replica, then the timed call."""
    info = llm.replicas.info
    prompts = [[t % info.vocab_size for t in pr] for pr in prompts]
    llm.generate(["Benchmark: ", "Warm-up: "], SamplingParams(max_tokens=16), use_tqdm=False)  # (one each)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    print(f"minisrv [{info.backend_name}, {info.device}, dp {len(llm.replicas.replicas.clients)}]: {n} output tokens "
          f"in {dt:.2f}s = {n / dt:.1f} output tok/s; ready in {t_ready:.1f}s")
    for r in sorted({r for r, _ in llm.replicas.last_call}):  # each replica's share: balance, and its own pace
        mine = [(o, s) for o, (q, s) in zip(outs, llm.replicas.last_call) if q == r]
        print(f"  replica {r}: {len(mine)} requests, {sum(len(o.token_ids) for o, _ in mine)} output tokens, "
              f"{sum(len(o.prompt_token_ids) for o, _ in mine)} prompt tokens, done at {max(s for _, s in mine):.2f}s")
    llm.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_args(p)
    p.add_argument("--workload", choices=("auto", "nano", "cpu", "shared", "prefix", "code-edit"), default="auto")
    p.add_argument("--sequential", action="store_true",
                   help="one generate call a request, one after another (the clock over all of them)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--dp-size", type=int, default=1,
                   help="engine replicas (LLM(dp_size)), each on its own GPUs: only the clock is reported")
    p.add_argument("--min-input-len", type=int, default=None)
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--min-output-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--hf", dest="hf", action="store_true", default=None, help="also time HF single-stream")
    p.add_argument("--no-hf", dest="hf", action="store_false")
    p.add_argument("--profile", action="store_true", help="print where a step's time goes")
    p.add_argument("--cprofile", action="store_true",
                   help="print the host's top Python functions over the timed run (their overhead slows it)")
    p.add_argument("--steps", action="store_true",
                   help="print step times by kind and batch size (no synchronisation added)")
    p.add_argument("--json-schema", nargs="?", const=json.dumps(BENCH_SCHEMA), default=None, metavar="SCHEMA",
                   help="generate every request under this JSON schema (JSON text; without a value: "
                        f"{json.dumps(BENCH_SCHEMA)})")
    p.add_argument("--json", help="append the result as one JSON line to this file")
    p.set_defaults(log_level="warning")  # (the engine's own default is info)
    a = p.parse_args()
    cuda = torch.cuda.is_available() and a.device != "cpu"
    workload = a.workload if a.workload != "auto" else ("nano" if cuda else "cpu")
    if workload == "prefix":
        big = cuda
        n = (8 if big else 2) * (32 if big else 8)
        out = (32, a.max_output_len or 128) if big else (16, a.max_output_len or 16)
        prompts, params = prefix_workload(8 if big else 2, 4096 if big else 512, 32 if big else 8, out)
    elif workload == "shared":
        n = a.num_prompts or 256
        prompts, params = shared_workload(n)
    elif workload == "nano":
        n = a.num_prompts or 256
        prompts, params = nano_workload(n, (a.min_input_len or 100, a.max_input_len or 1024),
                                        (a.min_output_len or 100, a.max_output_len or 1024))
    elif workload == "code-edit":
        n = a.num_prompts or 4
        prompts, params = [], []  # built from the model's chat template once it is loaded
    else:
        n = a.num_prompts or 32
        prompts, params = cpu_workload(n, (a.min_input_len or 64, a.max_input_len or 256), a.max_output_len or 64)

    from minisrv.llm import LLM
    t_start = time.perf_counter()
    llm = LLM(dp_size=a.dp_size, **vars(EngineConfig.from_args(a)))
    t_ready = time.perf_counter() - t_start
    if a.dp_size > 1:  # the engines run in processes of their own: the clock only
        return time_replicas(llm, prompts, params, t_ready)
    eng = llm.engine
    if workload == "code-edit":
        prompts, params = code_edit_workload(llm, n, a.max_output_len or 1024)
    if a.json_schema is not None:
        params = [dataclasses.replace(sp, json_schema=a.json_schema) for sp in params]
    vocab = eng.parts.args.vocab_size
    prompts = [[t % vocab for t in pr] for pr in prompts]
    # warm-up (with the schema: its grammar is compiled here, as a server that has seen it once has it cached)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16, json_schema=a.json_schema), use_tqdm=False)
    freeze_startup_heap()  # as the generate script and the server's engine process do
    timings = time_phases(eng) if a.profile else None
    eng.peak_pages_used = 0
    eng.num_cached_prompt_tokens = 0
    eng.runner.wait_s = 0.0
    eng.runner.num_cascade_steps = 0
    trace = trace_steps(eng) if a.steps else None
    window_peak = watch_window_pool(eng) if eng.parts.window_allocator is not None else None
    cprof = None
    if a.cprofile:
        import cProfile
        cprof = cProfile.Profile()
        cprof.enable()
    stats_before = eng.stats()
    t = time.perf_counter()
    if a.sequential:
        outs = [out for pr, sp in zip(prompts, params) for out in llm.generate([pr], [sp], use_tqdm=False)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    spec = None
    if getattr(eng, "speculator", None) is not None:
        counters = speculation_counters(stats_before, eng.stats())
        spec = {"spec_algorithm": eng.config.speculative_algorithm,
                "spec_num_draft_tokens": eng.config.speculative_num_draft_tokens, **counters,
                **{"spec_" + k: v for k, v in speculation_figures(counters).items()}}
    if cprof is not None:
        import pstats
        cprof.disable()
        pstats.Stats(cprof).sort_stats("tottime").print_stats(25)
    if trace is not None:
        print_steps(trace)
    if window_peak is not None:
        print_window_peak(eng, *window_peak)
    out_tokens = sum(len(o.token_ids) for o in outs)
    in_tokens = sum(len(pr) for pr in prompts)
    asked = sum(sp.max_tokens for sp in params)
    by_grammar = sum(1 for o in outs if o.finish_reason == "stop")  # ignore_eos: only a grammar stops one early
    result = {
        "workload": workload, "constrained": a.json_schema is not None, "json_schema": a.json_schema,
        "model": eng.parts.model_path, "dtype": str(eng.parts.dtype).replace("torch.", ""),
        "kv_dtype": str(eng.parts.pool.kv_dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "backend": eng.parts.backend_name,
        "num_prompts": n, "input_tokens": in_tokens, "output_tokens": out_tokens, "max_output_tokens": asked,
        "mean_output_tokens": round(out_tokens / n, 1), "ended_by_grammar": by_grammar, "time_s": round(dt, 3),
        "output_tok_s": round(out_tokens / dt, 1), "ready_s": round(t_ready, 1),
        "peak_kv_tokens": eng.peak_pages_used * eng.parts.pool.page_size, "kv_pool_tokens": eng.parts.pool.num_slots,
        "retractions": eng.scheduler.num_retractions,
        "graph_capture_s": getattr(eng.runner.graph_runner, "capture_s", None),
        "host_wait_s": round(eng.runner.wait_s, 3),
        "radix_cache": eng.cache is not None, "cache_hit_rate": round(eng.num_cached_prompt_tokens / in_tokens, 3),
        "cascade_attention": eng.runner.cascade is not None, "cascade_steps": eng.runner.num_cascade_steps,
        "tp_size": eng.config.tp_size, "sequential": a.sequential, **(spec or {}),
    }
    if workload == "code-edit":
        for key, share in (("copied_8gram_fraction", copied_fraction), ("copied_in_order_fraction",
                                                                         copied_in_order_fraction)):
            copied = sum(share(o.prompt_token_ids, o.token_ids) * len(o.token_ids) for o in outs)
            result[key] = round(copied / max(out_tokens, 1), 3)
    if a.json_schema is not None:
        print(f"workload {workload}, CONSTRAINED: every request under the JSON schema {a.json_schema}; "
              f"{by_grammar} of {n} requests ended by the grammar")
    tp = f", tp {eng.config.tp_size}" if eng.config.tp_size > 1 else ""
    print(f"minisrv [{result['backend']}, {result['dtype']}, KV {result['kv_dtype']}, {result['device']}{tp}]: "
          f"{out_tokens} output tokens (of {asked} asked for; mean {out_tokens / n:.1f} a request; {in_tokens} "
          f"input) in {dt:.2f}s = {out_tokens / dt:.1f} output tok/s; ready in {t_ready:.1f}s; "
          f"peak KV {result['peak_kv_tokens']} of {result['kv_pool_tokens']} tokens; "
          f"{result['retractions']} retractions; graph capture {result['graph_capture_s']}s; "
          f"host waited for the device {eng.runner.wait_s:.2f}s; prefix cache "
          f"{'hit rate ' + format(result['cache_hit_rate'], '.1%') if eng.cache is not None else 'off'}"
          + (f"; {result['cascade_steps']} cascade decode steps" if result["cascade_attention"] else "")
          + (f"; {n} requests one at a time" if a.sequential else "")
          + (f"; output tokens inside an 8-gram of the prompt {result['copied_8gram_fraction']:.1%}, copied from "
             f"it in order {result['copied_in_order_fraction']:.1%}" if workload == "code-edit" else "")
          + (f"; speculation {spec['spec_algorithm']} ({spec['spec_num_draft_tokens']} tokens scored a request "
             f"a verify step): " + (f"acceptance rate {spec['spec_acceptance_rate']:.1%}, mean accepted length "
                                    f"{spec['spec_mean_accepted_length']:.2f} over {spec['spec_verify_steps']} "
                                    f"verify steps" if spec["spec_verify_steps"] else "no verify step")
             if spec is not None else ""))
    if a.profile:
        tm = timings
        total = sum(tm.values())
        print("profile (s, share of step time):")
        for k, v in sorted(tm.items(), key=lambda kv: -kv[1]):
            print(f"  {k:16s} {v:8.3f}  {100 * v / total:5.1f}%")
    if a.hf if a.hf is not None else (workload == "cpu" and a.json_schema is None):  # HF has no grammar
        model = hf_model(eng.parts.model_path, eng.parts.dtype, eng.parts.device)
        out_len = params[0].max_tokens
        hf = hf_single_stream(model, prompts, out_len, eng.parts.device)
        result["hf_single_stream_tok_s"] = round(hf, 1)
        result["speedup_vs_hf"] = round(out_tokens / dt / hf, 2)
        print(f"HF transformers single-stream generate: {hf:.1f} output tok/s -> minisrv is "
              f"{out_tokens / dt / hf:.2f}x")
    if a.json_schema is not None:
        # the same prompts again without the grammar, each made to stop at the length its constrained twin reached
        # (the cache emptied first, so their prompts are computed again): the same work but for the grammar's
        eng.flush_cache()
        twins = [dataclasses.replace(sp, json_schema=None, max_tokens=len(o.token_ids))
                 for sp, o in zip(params, outs)]
        t = time.perf_counter()
        twin_outs = llm.generate(prompts, twins, use_tqdm=False)
        dt_twin = time.perf_counter() - t
        twin_tokens = sum(len(o.token_ids) for o in twin_outs)
        assert twin_tokens == out_tokens, (twin_tokens, out_tokens)
        result.update(unconstrained_same_lengths_time_s=round(dt_twin, 3),
                      unconstrained_same_lengths_tok_s=round(twin_tokens / dt_twin, 1),
                      constrained_relative_speed=round(dt_twin / dt, 3))
        print(f"the same prompts and output lengths unconstrained: {twin_tokens} output tokens (mean "
              f"{twin_tokens / n:.1f}) in {dt_twin:.2f}s = {twin_tokens / dt_twin:.1f} output tok/s; constrained "
              f"runs at {dt_twin / dt:.1%} of that speed")
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
