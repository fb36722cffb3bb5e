#!/usr/bin/env python
"""A 4-bit copy of a float safetensors checkpoint directory (one file or shards with an index), for benchmarks on
random or real weights: every decoder projection (`model.layers.*_proj.weight`, a mixture of experts' experts
included, Mixtral's `experts.*.w1/w2/w3` too; routers stay as they are) quantised by
round-to-nearest in groups along K and packed as AWQ (GEMM layout), GPTQ (classic or gptq_v2, optionally in a random
activation order, as desc_act checkpoints are) or compressed-tensors pack-quantized (by the compressed-tensors
library, which must be installed); the embedding, norms and lm_head are copied as they are. config.json gains the
format's quantization_config; every other file (tokenizer, generation config) is copied. The packers are the
tests' (tests/helpers/int4_checkpoints.py), so the file is what the CPU tests check minisrv's reading against.

Round-to-nearest is not AWQ's or GPTQ's calibrated quantisation: the values differ, the bytes' layout and the
arithmetic the kernels do are the same, which is what speed and loading depend on.

  python scripts/make_int4_checkpoint.py SRC DST --format gptq [--group 128] [--sym] [--desc-act] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tests.helpers.int4_checkpoints import PROJECTION, int4_parts, quantization_config, same_input  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a float safetensors checkpoint directory")
    p.add_argument("dst", help="where the 4-bit copy is written (must not exist)")
    p.add_argument("--format", required=True, choices=("awq", "gptq", "gptq_v2", "compressed-tensors"))
    p.add_argument("--group", type=int, default=128, help="rows of K a scale covers (0: one per output channel)")
    p.add_argument("--sym", action="store_true", help="symmetric (zero point 8; GPTQ and compressed-tensors only)")
    p.add_argument("--desc-act", action="store_true", help="GPTQ: a random activation order (g_idx)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to quantise")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from safetensors import safe_open
    from safetensors.torch import save_file
    method, v2 = ("gptq", True) if a.format == "gptq_v2" else (a.format, False)
    if method == "awq" and (a.sym or a.desc_act):
        p.error("AWQ has zero points and no activation order")
    if a.desc_act and method != "gptq":
        p.error("--desc-act is GPTQ's")
    if os.path.exists(a.dst):
        p.error(f"{a.dst} exists")
    files = sorted(f for f in os.listdir(a.src) if f.endswith(".safetensors"))
    if not files:
        p.error(f"no .safetensors files in {a.src}")
    os.makedirs(a.dst)
    for f in os.listdir(a.src):  # config, tokenizer, ...: everything but the weights
        full = os.path.join(a.src, f)
        if os.path.isfile(full) and not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copy(full, os.path.join(a.dst, f))
    gen = torch.Generator().manual_seed(a.seed)
    orders, weight_map, t0 = {}, {}, time.time()
    for file in files:
        out = {}
        with safe_open(os.path.join(a.src, file), framework="pt") as f:
            for name in f.keys():
                w = f.get_tensor(name)
                m = PROJECTION.match(name)
                if m is None or not name.startswith("model.layers."):
                    out[name] = w
                    continue
                perm = None
                if a.desc_act:  # q/k/v and gate/up share their input, so their order
                    perm = orders.setdefault(same_input(m.group(1)), torch.randperm(w.shape[1], generator=gen))
                dtype = w.dtype if method == "compressed-tensors" else torch.float32  # (its scales: the model's)
                parts = int4_parts(w.to(a.device, dtype), method, a.group, a.sym, perm, v2)
                for leaf, t in parts.items():
                    out[f"{m.group(1)}.{leaf}"] = t.to("cpu").contiguous()
        save_file(out, os.path.join(a.dst, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in out})
        print(f"{file}: {len(out)} tensors written ({time.time() - t0:.0f}s)", flush=True)
    if len(files) > 1 or os.path.exists(os.path.join(a.src, "model.safetensors.index.json")):
        size = sum(os.path.getsize(os.path.join(a.dst, f)) for f in files)
        with open(os.path.join(a.dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": size}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(a.dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config(method, a.group, a.sym, a.desc_act, v2)
    with open(os.path.join(a.dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(f"{a.dst}: {a.format} group {a.group or 'per channel'}{' sym' if a.sym else ''}"
          f"{' desc_act' if a.desc_act else ''} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
