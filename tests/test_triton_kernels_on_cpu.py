"""The Triton kernels (minisrv/kernels/: the small-batch FP8 GEMM, the FP8 quantisers) under Triton's interpreter on the
CPU: their indexing, masking, K tiling, strides and scaling against torch (helpers/triton_interpreted_checks.py, run in
a fresh process because the interpreter must be switched on before Triton is imported). On the GPU the same kernels
are checked against torch._scaled_mm and torch's quantisers in tests/gpu/test_fp8_weights.py."""
from __future__ import annotations

import pytest

from .helpers.interpreted import needs_triton, run_checks


@pytest.mark.slow
@needs_triton
def test_fp8_triton_kernels_under_the_interpreter():
    out = run_checks("triton_interpreted_checks.py")
    assert out.count("small-M FP8 GEMM") == 20 and out.count("fused quantisers") == 6
    assert out.count("q/k norm + rotary + store") == 6
