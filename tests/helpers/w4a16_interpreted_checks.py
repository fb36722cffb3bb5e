"""The W4A16 GEMM (minisrv/kernels/w4a16_gemm.py) run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, set
before Triton is imported: hence a script of its own, run by tests/test_w4a16.py in a fresh process).

Checked against the float64 product of the dequantised weight (x @ ((q - zero) * scale)): row counts of the CUDA
cores' kernel, a few, a full split-K batch, a tiled batch and one dequantised whole (1, 2, 5, 64, 100, 130); group sizes
32, 64, 128 and one per channel; symmetric (zeros 8) and asymmetric zero points; output widths that are not a multiple
of the tile; the launch rules' own configurations and forced ones (split K over 1, 3 and 4 programs, K steps smaller
than a group, several rows on the CUDA cores, a dequantisation tile smaller than the rule's); a mixture of experts'
(token, expert) pairs on the CUDA cores' kernel, with and without routing weights;
float16 and float32 activations (the interpreter's bfloat16 products are not the GPU's: bfloat16 is checked on the
GPU, tests/gpu/test_w4a16.py). Prints one line per check; raises AssertionError on the first failure."""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minisrv.kernels.w4a16_gemm import W4A16Config, config_for, dequantize, pack_rows, w4a16_gemm  # noqa: E402


def random_weight(k: int, n: int, group: int, symmetric: bool, dtype: torch.dtype, seed: int):
    """(qweight, scales, zeros) of a random 4-bit [k, n] weight in groups of `group` (0: per channel)."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // (group or k)
    values = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(dtype)
    zeros = torch.full((groups, n), 8, dtype=torch.uint8) if symmetric else \
        torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.uint8)
    return pack_rows(values), scales, zeros


def check(run, m: int, n: int, k: int, group: int, symmetric: bool, dtype: torch.dtype, config=None) -> None:
    qweight, scales, zeros = random_weight(k, n, group, symmetric, torch.float16, seed=m * 7 + n + k + group)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 2).to(dtype)
    y = run(x, qweight, scales, zeros, config=config)
    ref = x.double() @ dequantize(qweight, scales, zeros, torch.float64)
    assert y.shape == (m, n) and y.dtype == dtype, (y.shape, y.dtype)
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    # the weight is rounded to the activations' dtype before the dot (float16: 2^-11 relative); a wrong index,
    # shift, zero or scale is off by O(1)
    bound = 2e-3 if dtype == torch.float16 else 1e-5
    c = config or config_for(m, n, k, group or k)
    assert err <= bound, f"m={m} n={n} k={k} group={group} sym={symmetric} {dtype} {tuple(c)}: error {err:.2e}"
    print(f"W4A16 GEMM m={m} n={n} k={k} group={group or 'channel'} {'sym' if symmetric else 'asym'} "
          f"{str(dtype)[6:]} {tuple(c)}: max error {err:.1e} of the largest output")


def check_pairs(run, top_k: int, weighted: bool, dtype: torch.dtype) -> None:
    """A mixture of experts' (token, expert) pairs on the CUDA cores' kernel: row p of the output is x[p // top_k]
    times expert ids[p]'s weight (times row_weights[p])."""
    e, k, n, tokens = 4, 256, 80, 3
    parts = [random_weight(k, n, 64, False, torch.float16, seed=j) for j in range(e)]
    qweight, scales, zeros = (torch.stack([p[i] for p in parts]) for i in range(3))
    gen = torch.Generator().manual_seed(top_k)
    ids = torch.randint(0, e, (tokens * top_k,), generator=gen, dtype=torch.int32)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    rw = torch.rand(tokens * top_k, generator=gen) if weighted else None
    y = run(x, qweight, scales, zeros, ids=ids, top_k=top_k, row_weights=rw)
    ref = torch.stack([x[p // top_k].double() @ dequantize(*(t[int(ids[p])] for t in (qweight, scales, zeros)),
                                                          torch.float64) for p in range(ids.numel())])
    if weighted:
        ref = ref * rw.double()[:, None]
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    bound = 2e-3 if dtype == torch.float16 else 1e-5
    what = f"top_k={top_k} weighted={weighted} {str(dtype)[6:]}"
    assert y.shape == ref.shape and err <= bound, f"pairs {what}: error {err:.2e}"
    print(f"W4A16 expert pairs {what}: max error {err:.1e}")


def main() -> None:
    run = w4a16_gemm()
    assert run is not None, "Triton is missing"
    for group in (32, 64, 128, 0):
        for symmetric in (True, False):
            for m in (1, 2, 5, 64, 100, 130):
                check(run, m, 96, 256, group, symmetric, torch.float16)
    for m in (1, 5, 64):  # float32 activations
        check(run, m, 72, 128, 64, False, torch.float32)
    for config in (W4A16Config(16, 32, 32, 3, 4, 2), W4A16Config(16, 64, 64, 4, 4, 2),  # split K, odd shares
                   W4A16Config(32, 32, 16, 1, 4, 2),
                   W4A16Config(8, 64, 32, 2, 2, 2), W4A16Config(8, 32, 64, 1, 4, 2),  # rows on the CUDA cores
                   W4A16Config(0, 64, 32, 1, 4, 1)):  # dequantised for torch's matmul
        check(run, 5, 200, 384, 128, False, torch.float16, config)
    for top_k, weighted, dtype in ((2, False, torch.float16), (1, True, torch.float32), (3, True, torch.float16)):
        check_pairs(run, top_k, weighted, dtype)
    print("ok")


if __name__ == "__main__":
    main()
