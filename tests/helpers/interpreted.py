"""The Triton kernels' checks under Triton's interpreter on the CPU: each is a script beside this file, run in a
fresh process because the interpreter must be switched on before Triton is imported."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def run_checks(script: str) -> str:
    """The output of tests/helpers/`script`, which must exit 0 with its last line "ok"."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    done = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
