#!/usr/bin/env python
"""Online serving benchmark against any OpenAI-compatible server (minisrv, SGLang, vLLM).

Requests arrive as a Poisson process at --request-rate (inf: all at once), optionally capped at
--max-concurrency in flight. Each request streams (/v1/completions, or /v1/chat/completions with --endpoint chat)
and is timed per SSE chunk (read without an HTTP library over plain http, with httpx over https), so TTFT and
inter-token latency are measured as a client sees them.
The requests are split over --client-processes worker processes (scripts/serving_client.py), so that reading the
streams does not cap what is measured; `client_cpu_s` in the results says how busy they were.
Output lengths are controlled with ignore_eos + max_tokens (both SGLang and vLLM accept ignore_eos).

`--constrained-fraction F` sends that fraction of the requests (every 1/F-th, spread evenly through the run) with
`response_format` `json_schema` (SCHEMA: one object with one string field; `--json-schema` for another), and
reports TTFT, ITL and E2E of the constrained and the unconstrained requests apart, besides all together: what
structured outputs cost the requests that ask for them, and the others sharing their batches. A grammar that is
complete ends its request despite ignore_eos, so the constrained requests' output lengths are reported too.

    python scripts/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 32 \\
        --random-input-len 128 --random-output-len 64 --request-rates 1,2,4,inf

writes bench-results/serving-<time>.json (and .png for a sweep) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from typing import Any, Dict, List

import httpx

from serving_client import Item, run_requests
from serving_report import latencies, plot, table

# common English words, each usually a single token with its leading space in BPE vocabularies
WORDS = ("the of and to in is that it was for on are as with his they at be this from have or by one had not "
         "but what all were when we there can an your which their said if do will each about how up out them then "
         "she many some so these would other into has more her two like him see time could no make than first "
         "been its who now people my made over did down only way find use may water long little very after words "
         "called just where most know get through back much go good new write our me man too any day same right "
         "look think also around another came come work three word must because does part even place well such "
         "here take why things help put years different away again off went old number great tell men say small "
         "every found still between name should home big give air line set own under read last never us left end "
         "along while might next sound below saw something thought both few those always looked show large often "
         "together asked house world going want school important until form food keep children feet land side "
         "without boy once animals life enough took sometimes four head above kind began almost live page got earth "
         "need far hand high year mother light parts country father let night following picture being study second "
         "eyes soon times story boys since white days ever paper hard near sentence better best across during today "
         "others however sure means knew try told young miles sun ways thing whole hear example heard several change "
         "answer room sea against top turned learn point city play toward five using himself usually").split()


# --constrained-fraction's schema: the model writes `{"text": "` and then stays inside the string, where nearly
# every token is allowed, until it writes a quote (as offline: scripts/bench_offline.py BENCH_SCHEMA)
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


# ---------------------------------------------------------------------------------------------- workload
def constrain(items: List[Item], fraction: float, schema: Any) -> None:
    """Give `fraction` of the items the schema, spread evenly: item i when floor((i + 1) * f) > floor(i * f)."""
    for i, item in enumerate(items):
        if math.floor((i + 1) * fraction) > math.floor(i * fraction):
            item.schema = schema


def random_items(n: int, in_len: int, out_len: int, ratio: float, seed: int, tokenizer: Any = None) -> List[Item]:
    """Lengths uniform in [len * ratio, len] (SGLang's convention). With a tokenizer the prompt is made of
    random token ids (so its length is exact); without one, of random common words (about one token each)."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        li = rng.randint(max(1, int(in_len * ratio)), max(1, in_len))
        lo = rng.randint(max(1, int(out_len * ratio)), max(1, out_len))
        if tokenizer is not None:
            specials = set(getattr(tokenizer, "all_special_ids", []) or [])
            vocab = [t for t in range(len(tokenizer)) if t not in specials]
            text = tokenizer.decode([rng.choice(vocab) for _ in range(li)])
        else:
            text = f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(max(1, li - 2)))
        items.append(Item(text, lo))
    return items


def dataset_items(path: str, n: int, out_len: int, seed: int) -> List[Item]:
    """JSONL with one of: prompt / text / messages; optional max_tokens or output_len per line."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            prompt = r.get("messages") or r.get("prompt") or r.get("text")
            if prompt is None:
                raise SystemExit(f"{path}: a line has none of prompt / text / messages")
            rows.append(Item(prompt, int(r.get("max_tokens") or r.get("output_len") or out_len)))
    if not rows:
        raise SystemExit(f"{path}: no prompts")
    rng = random.Random(seed)
    return [rows[i % len(rows)] for i in range(n)] if n <= len(rows) else [rng.choice(rows) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- one run
def run_once(args: argparse.Namespace, model: str, items: List[Item], rate: float) -> Dict[str, Any]:
    results, duration, client_cpu = run_requests(args, model, items, rate, args.client_processes)
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "request_rate": "inf" if rate == math.inf else rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": len(items),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "input_throughput": sum(r.prompt_tokens for r in ok) / duration,
        "output_throughput": out_tokens / duration,
        "client_processes": args.client_processes,
        "client_cpu_s": client_cpu,
        **latencies(ok),
    }
    constrained = [r for r in ok if r.constrained]
    if any(item.schema is not None for item in items):
        summary["constrained"] = {"num_prompts": sum(1 for item in items if item.schema is not None),
                                  **latencies(constrained)}
        summary["unconstrained"] = {"num_prompts": sum(1 for item in items if item.schema is None),
                                    **latencies([r for r in ok if not r.constrained])}
    return summary


def parse_rate(s: str) -> float:
    return math.inf if s.strip().lower() in ("inf", "infinity") else float(s)


async def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=30, headers=headers) as http:
        r = await http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=parse_rate, default=math.inf, help="req/s, Poisson; inf = all at once")
    p.add_argument("--request-rates", default=None, help="sweep, e.g. 1,2,4,inf (overrides --request-rate)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0, help="lengths uniform in [len*ratio, len]")
    p.add_argument("--dataset", default=None, help="JSONL of prompts (prompt / text / messages per line)")
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir or .gguf: random prompts of exact token length (default: random words)")
    p.add_argument("--constrained-fraction", type=float, default=0.0,
                   help="this fraction of the requests (0-1) asks for response_format json_schema")
    p.add_argument("--json-schema", default=None, help=f"the schema of constrained requests (JSON text; default "
                                                       f"{json.dumps(SCHEMA)})")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not measured) before each run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a request may take")
    p.add_argument("--httpx", action="store_true",
                   help="stream with httpx over plain http too (https always does; default: a bare HTTP/1.1 reader)")
    p.add_argument("--client-processes", type=int, default=0,
                   help="worker processes sending the requests (default: one per 128 of --num-prompts or "
                        "--max-concurrency, at most a quarter of the CPUs)")
    p.add_argument("--output", default=None, help="results JSON (default: bench-results/serving-<time>.json)")
    args = p.parse_args()

    if args.dataset:
        items = dataset_items(args.dataset, args.num_prompts, args.random_output_len, args.seed)
    else:
        tok = None
        if args.tokenizer:
            if args.tokenizer.endswith(".gguf"):
                from minisrv.checkpoints.loader import load_tokenizer
                tok = load_tokenizer(args.tokenizer)
            else:
                from transformers import AutoTokenizer
                tok = AutoTokenizer.from_pretrained(args.tokenizer)
        items = random_items(args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, args.seed, tok)
    if not 0.0 <= args.constrained_fraction <= 1.0:
        raise SystemExit("--constrained-fraction must be between 0 and 1")
    constrain(items, args.constrained_fraction, json.loads(args.json_schema) if args.json_schema else SCHEMA)
    if args.client_processes <= 0:
        concurrent = min(args.num_prompts, args.max_concurrency or args.num_prompts)
        args.client_processes = max(1, min(math.ceil(concurrent / 128), (os.cpu_count() or 1) // 4))
    args.client_processes = min(args.client_processes, args.num_prompts, args.max_concurrency or args.num_prompts)
    rates = [parse_rate(x) for x in args.request_rates.split(",")] if args.request_rates else [args.request_rate]
    model = asyncio.run(resolve_model(args))
    out = args.output or os.path.join("bench-results", f"serving-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    rows = []
    for rate in rates:
        print(f"rate {rate}: {len(items)} requests ...", file=sys.stderr, flush=True)
        row = run_once(args, model, items, rate)
        rows.append(row)
        print(f"  done {row['completed']}/{row['num_prompts']} in {row['duration_s']:.1f}s, "
              f"{row['output_throughput']:.1f} out tok/s, TTFT p50 {row['ttft_ms']['p50']:.0f} ms, "
              f"ITL p50 {row['itl_ms']['p50']:.0f} ms", file=sys.stderr, flush=True)
        for kind in ("constrained", "unconstrained"):
            if kind in row:
                part = row[kind]
                print(f"  {kind}: {part['completed']}/{part['num_prompts']}, mean {part['mean_output_tokens']:.1f} "
                      f"output tokens, ITL p50 {part['itl_ms']['p50']:.1f} ms, p99 {part['itl_ms']['p99']:.1f} ms",
                      file=sys.stderr, flush=True)
        if row["failed"]:
            print(f"  errors: {row['errors']}", file=sys.stderr)

    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config["request_rate"] = str(config["request_rate"])
    with open(out, "w") as f:
        json.dump({"model": model, "config": config, "command": " ".join(sys.argv), "results": rows}, f, indent=2)
    print(table(rows))
    print(f"\nresults: {out}")
    if len(rows) > 1:
        png = os.path.splitext(out)[0] + ".png"
        plot(rows, png, f"{model} @ {args.base_url}: in {args.random_input_len}, out {args.random_output_len}, "
                        f"{args.num_prompts} prompts")
        print(f"plot: {png}")


if __name__ == "__main__":
    main()
