"""The Triton kernels (minisrv/kernels/: the small-batch FP8 GEMM, the FP8 quantisers) under Triton's interpreter on the CPU:
their indexing, masking, K tiling, strides and scaling against torch (helpers/triton_interpreted_checks.py, run in a
fresh process because the interpreter must be switched on before Triton is imported). On the GPU the same kernels
are checked against torch._scaled_mm and torch's quantisers in tests/gpu/test_fp8_weights.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "triton_interpreted_checks.py")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_fp8_triton_kernels_under_the_interpreter():
    done = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("small-M FP8 GEMM") == 20 and done.stdout.count("fused quantisers") == 6
    assert done.stdout.count("q/k norm + rotary + store") == 6
