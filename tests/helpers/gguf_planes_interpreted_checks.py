"""The W4A16 GEMM over GGUF blocks kept as planes (minisrv/models/gguf_planes.py, kernels/w4a16_gemm.py) run by
Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before Triton is imported: a script of its own, run by
tests/test_gguf_planes.py in a fresh process).

Each GPU block type's random blocks (every byte drawn, the float16 scales finite) converted to planes, then y = x W^T
checked against the float64 product with gguf's own dequantisation of the same bytes (gguf.quants.dequantize):
rows on the CUDA cores' kernel (1, 2: K steps of one sub-block), the tensor cores' with K split (5, 64), one
dequantised whole (130); an output width that is not a multiple of the tile; forced configurations (several rows on
the CUDA cores, K steps spanning two of Q6_K's sub-blocks there, no split); the product written into a column slice
of a wider output (a fused projection's parts).
float16 and float32 activations (the interpreter's bfloat16 products are not the GPU's: tests/gpu/test_gguf_gpu.py).
Prints one line per check; raises AssertionError on the first failure."""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minisrv.kernels.w4a16_gemm import W4A16Config, w4a16_gemm  # noqa: E402
from minisrv.models.gguf_planes import PLANE_FORMATS, to_planes  # noqa: E402
from tests.helpers.kquant_blocks import random_blocks  # noqa: E402


def check(run, kind: int, m: int, n: int, k: int, dtype: torch.dtype, config=None, into=False) -> None:
    raw = random_blocks(Q(kind).name, n, k, seed=m + n + k + int(kind), small=True)
    ref_w = dequantize(raw, Q(kind)).astype(np.float64).reshape(n, k)
    planes = to_planes(raw, kind, n, k, None, torch.device("cpu"))
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 2).to(dtype)
    if into:  # the product written into columns [3, 3 + n) of a wider output
        wide = torch.full((m, n + 7), 5.0, dtype=dtype)
        run(x, planes, config=config, out=wide[:, 3:3 + n])
        assert (wide[:, :3] == 5).all() and (wide[:, 3 + n:] == 5).all(), "wrote outside its columns"
        y = wide[:, 3:3 + n]
    else:
        y = run(x, planes, config=config)
    ref = x.double() @ torch.from_numpy(ref_w).t()
    assert y.shape == (m, n) and y.dtype == dtype, (y.shape, y.dtype)
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    # float16: the weight is rounded to 2^-11 relative before the dot; a wrong plane, shift or scale is off by O(1)
    bound = 2e-3 if dtype == torch.float16 else 1e-5
    c = tuple(config) if config else "launch rule"
    assert err <= bound, f"{Q(kind).name} m={m} n={n} k={k} {dtype} {c} into={into}: error {err:.2e}"
    print(f"GGUF {Q(kind).name} GEMM m={m} n={n} k={k} {str(dtype)[6:]} {c}{' into a slice' if into else ''}:"
          f" max error {err:.1e} of the largest output")


def main() -> None:
    run = w4a16_gemm()
    assert run is not None, "Triton is missing"
    for kind in PLANE_FORMATS:
        for m in (1, 2, 5, 64, 130):
            check(run, kind, m, 72, 512, torch.float16)
        check(run, kind, 3, 40, 256, torch.float32)
        check(run, kind, 2, 40, 256, torch.float16, into=True)
        check(run, kind, 20, 40, 256, torch.float16, into=True)
    for config in (W4A16Config(8, 64, 32, 2, 2, 2), W4A16Config(16, 32, 32, 1, 4, 2),
                   W4A16Config(16, 64, 64, 3, 4, 2), W4A16Config(0, 32, 32, 1, 4, 1)):
        for kind in (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_1):
            check(run, kind, 5, 100, 768, torch.float16, config)
    print("ok")


if __name__ == "__main__":
    main()
