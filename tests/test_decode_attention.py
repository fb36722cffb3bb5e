"""The Triton decode-attention kernel (minisrv/kernels/decode_attention.py) under Triton's interpreter on the CPU:
paging, pieces and their merge, GQA grouping, partial tiles and FP8 scales against its torch reference and float64
attention (helpers/decode_attention_checks.py, in a fresh process: the interpreter must be switched on before
Triton is imported). On the GPU: tests/gpu/test_decode_attention.py and the backend cases of test_backends.py."""
from __future__ import annotations

import pytest

from minisrv.kernels.decode_attention import MAX_SPLITS, splits_for

from .helpers.interpreted import needs_triton, run_checks


@pytest.mark.slow
@needs_triton
def test_decode_attention_under_the_interpreter():
    out = run_checks("decode_attention_checks.py")
    assert out.count("max error") == 5 and "strided q" in out


def test_split_rule():
    """Pieces are a power of two, at most MAX_SPLITS; a batch that fills the GPU by itself is not split."""
    for bs in (1, 2, 3, 7, 64, 65, 256, 1024):
        for hkv in (1, 4, 8):
            s = splits_for(bs, hkv)
            assert 1 <= s <= MAX_SPLITS and s & (s - 1) == 0
    assert splits_for(1, 4) == MAX_SPLITS and splits_for(64, 4) == 1 and splits_for(8, 4) == 8
