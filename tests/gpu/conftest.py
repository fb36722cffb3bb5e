"""Fixtures of the GPU tests (helpers are in common.py)."""
import pytest

from .common import free_cuda, hf_model


@pytest.fixture(scope="module")
def hf():
    """HF transformers' model of the checkpoint, in bf16 on the GPU, for one test module."""
    m = hf_model()
    yield m
    del m
    free_cuda()
