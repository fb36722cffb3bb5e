"""Host time a decode step spends on structured outputs, measured without a model: for B requests under a JSON
schema, each step feeds every request's sampled token to its matcher (`GrammarState.advance`, as Engine._news does)
and fills the next step's masks in host memory (`fill_host_bitmask`, as SamplingBatch.build does before the copy to
the device, which is not timed: it needs a GPU). Median milliseconds per step, for several batch sizes and xgrammar
thread counts.

The vocabulary is the one the structured-output benchmark uses on the GPU (scripts/json_tokenizer.py: the
95 printable ASCII characters, then words up to 151,936 tokens, Qwen's vocabulary size), so the masks are as wide as
there. The tokens fed are string content ("a", " ", a word), which keeps every request inside the JSON string, as
the benchmark's requests mostly are.

    python scripts/bench_grammar_host.py [--batch-sizes 64,256] [--threads 1,2,8] [--steps 200]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 151936
SCHEMA = json.dumps({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})


def json_tokenizer(vocab_size: int):
    """The GPU benchmark's tokenizer (scripts/json_tokenizer.py), loaded back as AutoTokenizer loads it."""
    from json_tokenizer import json_tokenizer as build
    from transformers import AutoTokenizer
    with tempfile.TemporaryDirectory() as d:
        build(vocab_size, vocab_size - 1).save_pretrained(d)
        return AutoTokenizer.from_pretrained(d)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--threads", default="1,2,8", help="xgrammar threads of the batch fill")
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    from minisrv.engine import grammar as grammar_mod
    from minisrv.engine.request import Request, SamplingParams

    tok = json_tokenizer(VOCAB)
    backend = grammar_mod.GrammarBackend(tok, VOCAB, [VOCAB - 1])
    opening = tok.convert_tokens_to_ids(list('{"text": "'))
    content = [tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids(" "), tok.convert_tokens_to_ids("w700")]
    print(f"JSON schema {SCHEMA}, vocabulary {VOCAB}, {os.cpu_count()} CPUs; ms per step (median of {a.steps})")
    for bs in (int(x) for x in a.batch_sizes.split(",")):
        for threads in (int(x) for x in a.threads.split(",")):
            grammar_mod.BATCH_FILL_THREADS = threads
            backend._batch_filler = None  # made again with this thread count
            reqs = []
            for _ in range(bs):
                req = Request([1, 2, 3], SamplingParams(), 10 ** 6)
                req.grammar = backend.submit(SamplingParams(json_schema=SCHEMA))
                req.grammar.future.result()
                req.grammar.poll()
                for t in opening:
                    req.grammar.advance(t)
                reqs.append(req)
            accept, fill = [], []
            for step in range(a.steps):
                t0 = time.perf_counter()
                for i, r in enumerate(reqs):
                    r.grammar.advance(content[(i + step) % len(content)])
                t1 = time.perf_counter()
                grammar_mod.fill_host_bitmask(reqs, list(range(bs)))
                t2 = time.perf_counter()
                accept.append(t1 - t0)
                fill.append(t2 - t1)
            acc, fil = statistics.median(accept) * 1e3, statistics.median(fill) * 1e3
            print(f"batch {bs:4d}, {threads} thread(s): accept {acc:.3f} ms, masks {fil:.3f} ms, "
                  f"together {acc + fil:.3f} ms")


if __name__ == "__main__":
    main()
