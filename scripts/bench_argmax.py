#!/usr/bin/env python
"""Greedy decoding's argmax alone: torch.argmax against the two-kernel Triton row argmax (engine/argmax_kernel.py)
that greedy steps take on CUDA, over float32 logits of a Llama-3 vocabulary at decode batch sizes. Each call runs
--iters times in a CUDA graph; the median of --repeat replays is reported.

  python scripts/bench_argmax.py [--vocab 128256] [--rows 1,16,64,256]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from graph_timing import add_timing_args, graph_us  # noqa: E402 (beside this script)

from minisrv.engine.argmax_kernel import row_argmax  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", default="1,16,64,256")
    add_timing_args(p, repeat=20)
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; us per argmax of [rows, {a.vocab}] float32 (median of {a.repeat} x {a.iters})")
    for rows in (int(r) for r in a.rows.split(",")):
        logits = torch.randn(rows, a.vocab, device="cuda")
        assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
        torch_us = graph_us(lambda: logits.argmax(dim=-1), a.iters, a.repeat)
        triton_us = graph_us(lambda: row_argmax(logits), a.iters, a.repeat)
        print(f"rows {rows:4d}: torch {torch_us:7.1f} us, triton {triton_us:7.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
