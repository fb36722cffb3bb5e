#!/usr/bin/env python
"""minisrv beside llama.cpp on the CPU: the same GGUF, the same prompts, in one process run.

Workloads (the token ids of scripts/bench_offline.py's `cpu` workload, greedy, end of text ignored):
  batched  32 prompts of 64-256 tokens (5,304 in all), 64 output tokens each. minisrv: one `generate` call
           (continuous batching). llama.cpp: the 32 sequences decoded together in one context (`n_seq_max` 32),
           every prompt in the first decode calls, then one token per sequence a step.
  single   one prompt of 256 tokens, 128 output tokens.
Each figure is output tokens over the whole time (prompt included), the median of `--repeats` runs; the prompt
step (every prompt computed, first tokens sampled) is timed on its own as well. llama.cpp runs through
llama-cpp-python (`pip install -e ".[bench]"`; it compiles llama.cpp on install: `CMAKE_ARGS="-DGGML_NATIVE=ON"`
builds it for this CPU), with as many threads as torch uses. `--llamacpp-model` adds other GGUF files of the same
model to llama.cpp's runs (an F16 or F32 file made with llama.cpp's quantize tool); `--flash-attn` runs llama.cpp
with its flash attention too.

  python scripts/bench_llamacpp.py                                  # the default model, both engines
  python scripts/bench_llamacpp.py --llamacpp-model /tmp/smol-f32.gguf --flash-attn --repeats 3
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_offline import cpu_workload  # noqa: E402


def single_prompt(vocab: int, length: int = 256, seed: int = 1) -> List[int]:
    random.seed(seed)
    return [random.randint(0, 10000) % vocab for _ in range(length)]


class LlamaCppRunner:
    """Greedy decoding of many sequences at once through llama.cpp's C API (llama_cpp's low-level bindings)."""

    def __init__(self, path: str, n_seq: int, n_ctx: int, threads: int, flash_attn: bool) -> None:
        import llama_cpp
        self.lc = lc = llama_cpp
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 2048, 512, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        if hasattr(cp, "flash_attn_type"):  # newer llama.cpp: -1 auto, 0 off, 1 on
            cp.flash_attn_type = 1 if flash_attn else 0
        elif hasattr(cp, "flash_attn"):
            cp.flash_attn = flash_attn
        if hasattr(cp, "kv_unified"):
            cp.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(max(2048, n_seq), 0, n_seq)
        self.chunk = 2048

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, items: Sequence[Tuple[int, int, int, bool]]) -> List[int]:
        """items: (token, position, sequence, wants logits); returns the greedy token of each item wanting one."""
        import numpy as np
        lc, b = self.lc, self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for i, item in enumerate(items):
            if item[3]:
                row = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def generate(self, prompts: List[List[int]], out_len: int) -> Tuple[List[List[int]], float, float]:
        """Greedy tokens of every prompt, decoded together; (tokens, prompt-step seconds, total seconds)."""
        mem = self.lc.llama_get_memory(self.ctx)
        self.lc.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        items = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        firsts: List[int] = []
        for start in range(0, len(items), self.chunk):
            firsts += self._decode(items[start:start + self.chunk])
        outs = [[t] for t in firsts]
        t_prompt = time.perf_counter() - t0
        for step in range(1, out_len):
            nxt = self._decode([(o[-1], len(p) + step - 1, s, True) for s, (p, o) in enumerate(zip(prompts, outs))])
            for o, t in zip(outs, nxt):
                o.append(t)
        return outs, t_prompt, time.perf_counter() - t0


def run_minisrv(llm, prompts: List[List[int]], out_len: int) -> Tuple[List[List[int]], float, float]:
    from minisrv.engine.request import SamplingParams
    one = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1) for _ in prompts]
    t0 = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    t_prompt = time.perf_counter() - t0
    llm.engine.flush_cache()  # the timed run computes its prompts again
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len) for _ in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t0
    llm.engine.flush_cache()
    return [o.token_ids for o in outs], t_prompt, total


def agreement(a: List[List[int]], b: List[List[int]]) -> float:
    """Share of sequences whose greedy tokens agree in full."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the GGUF both engines run (default: the default model)")
    p.add_argument("--llamacpp-model", action="append", default=[], help="another GGUF for llama.cpp alone")
    p.add_argument("--flash-attn", action="store_true", help="also run llama.cpp with flash attention")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", default="batched,single")
    p.add_argument("--gguf-weights", default="auto",
                   help="minisrv's --gguf-weights, a comma list to run it once each (e.g. blocks,float32)")
    p.add_argument("--no-minisrv", action="store_true")
    p.add_argument("--no-llamacpp", action="store_true")
    a = p.parse_args()
    from minisrv.llm import LLM
    from minisrv.models.block_layers import BlockLinear
    from minisrv.checkpoints.model_files import default_model_path
    model = a.model or default_model_path()
    threads = torch.get_num_threads()
    settings = [] if a.no_minisrv else [w for w in a.gguf_weights.split(",") if w]
    llm = LLM(model=model, log_level="warning", gguf_weights=settings[0]) if settings else None
    vocab = llm.engine.parts.args.vocab_size if llm is not None else 49152
    prompts, _ = cpu_workload(32, (64, 256), 64)
    loads = {"batched": ([[t % vocab for t in pr] for pr in prompts], 64), "single": ([single_prompt(vocab)], 128)}
    wanted = [w for w in a.workloads.split(",") if w]
    rows: List[Tuple[str, str, float, float, str]] = []
    reference: Dict[str, List[List[int]]] = {}

    def measure(name: str, fn) -> None:
        for w in wanted:
            ps, out_len = loads[w]
            fn_out = [fn(ps, out_len) for _ in range(a.repeats)]
            toks = fn_out[0][0]
            tok_s = statistics.median(sum(len(o) for o in r[0]) / r[2] for r in fn_out)
            prompt_s = statistics.median(r[1] for r in fn_out)
            same = "" if w not in reference else f"{agreement(toks, reference[w]):.0%} of sequences as minisrv"
            reference.setdefault(w, toks)
            rows.append((name, w, tok_s, prompt_s, same))
            print(f"{name} {w}: {tok_s:.1f} output tok/s, prompt step {prompt_s:.2f} s {same}", flush=True)

    for i, setting in enumerate(settings):
        from minisrv.engine.request import SamplingParams
        if i:
            llm.close()
            llm = LLM(model=model, log_level="warning", gguf_weights=setting)
        llm.generate(["Benchmark: "], SamplingParams(max_tokens=4), use_tqdm=False)
        weights = "blocks" if isinstance(llm.engine.runner.model.model.embed_tokens, BlockLinear) else \
            str(llm.engine.parts.dtype).replace("torch.", "")
        measure(f"minisrv ({weights}, {llm.engine.parts.backend_name})", lambda ps, n, m=llm: run_minisrv(m, ps, n))
    if not a.no_llamacpp:
        for path in [model, *a.llamacpp_model]:
            for fa in ([False, True] if a.flash_attn else [False]):
                runner = LlamaCppRunner(path, 32, 16384, threads, fa)
                runner.generate([loads["single"][0][0][:16]], 4)  # warm-up
                measure(f"llama.cpp {os.path.basename(path)}{' +FA' if fa else ''}",
                        lambda ps, n, r=runner: r.generate(ps, n))
                runner.close()
    print(f"\n{threads} threads, load average {os.getloadavg()[0]:.2f}; medians of {a.repeats}")
    print("| engine | workload | output tok/s | prompt step s | same greedy tokens |")
    print("| --- | --- | ---: | ---: | --- |")
    for name, w, tok_s, prompt_s, same in rows:
        print(f"| {name} | {w} | {tok_s:.1f} | {prompt_s:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
