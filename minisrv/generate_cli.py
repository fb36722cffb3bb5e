"""Offline batch generation from the command line (scripts/generate.py and the `minisrv-generate` command).

Prompts come from arguments or a JSONL file (one {"prompt": ...} or {"messages": [...]} object, or a bare JSON
string, per line); outputs are printed, or written as JSONL with --output.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional

from minisrv.config import EngineConfig
from minisrv.engine.request import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--min-p", type=float, default=d.min_p)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (same seed, same output)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, help="return the chosen token's logprob and the top N")


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, seed=a.sampling_seed, presence_penalty=a.presence_penalty,
                          frequency_penalty=a.frequency_penalty, repetition_penalty=a.repetition_penalty,
                          stop=a.stop, stop_token_ids=a.stop_token_ids, ignore_eos=a.ignore_eos,
                          logprobs=a.logprobs)


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    items = []
    with (sys.stdin if path == "-" else open(path)) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if isinstance(obj, str):
                obj = {"prompt": obj}
            if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
                raise ValueError(f"{path}:{n}: expected a string or an object with 'prompt' or 'messages'")
            items.append(obj)
    return items


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", nargs="*", help="prompts (default: a few examples)")
    p.add_argument("--input", "-i", help="JSONL file of prompts ('-' for stdin)")
    p.add_argument("--output", "-o", help="write results as JSONL here instead of printing")
    p.add_argument("--chat", action="store_true", help="wrap plain prompts in the chat template as a user turn")
    p.add_argument("--dp-size", "--dp", dest="dp_size", type=int, default=1,
                   help="engine replicas sharing the prompts, each on its own GPUs (--tp-size of them)")
    EngineConfig.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(log_level="warning")  # (the engine's own default is info)
    a = p.parse_args(argv)

    items: List[Dict[str, Any]] = [{"prompt": s} for s in a.prompts]
    if a.input:
        items += read_jsonl(a.input)
    if not items:
        items = [{"messages": [{"role": "user", "content": q}]} for q in
                 ("What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 12?")]
    params = sampling_from_args(a)

    from minisrv.llm import LLM
    from minisrv.utils import freeze_startup_heap
    cfg = EngineConfig.from_args(a)
    if cfg.node_rank > 0:  # node 0 generates; this node runs only its tensor-parallel ranks
        from minisrv.engine.tp_workers import serve_node
        return serve_node(cfg)
    llm = LLM(dp_size=a.dp_size, **vars(cfg))
    freeze_startup_heap()
    prompts = [llm.encode_chat(it["messages"] if "messages" in it else [{"role": "user", "content": it["prompt"]}])
               if "messages" in it or a.chat else it["prompt"] for it in items]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    ntok = sum(len(o.token_ids) for o in outs)
    sink = open(a.output, "w") if a.output else None
    for it, o in zip(items, outs):
        rec = {**it, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
        if o.logprobs is not None:
            rec["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                                "top": {str(k): v for k, v in lp.top.items()}} for lp in o.logprobs]
        if sink:
            sink.write(json.dumps(rec) + "\n")
        else:
            shown = it.get("prompt") or it["messages"][-1]["content"]
            print(f"### {shown}\n{o.text}\n[{o.finish_reason}, {len(o.token_ids)} tokens]\n")
    if sink:
        sink.close()
    print(f"{len(outs)} requests, {ntok} output tokens in {dt:.2f}s ({ntok / dt:.1f} tok/s), "
          f"backend {llm.engine.parts.backend_name if llm.engine is not None else llm.replicas.info.backend_name}"
          + (f", {a.dp_size} replicas" if a.dp_size > 1 else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
