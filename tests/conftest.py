"""Fixtures of the CPU suite: tiny random-weight HF checkpoints built once a session. The helpers the tests share
(the checkpoints' builder, the HF float64 reference, the engine watcher, a server process, ...) are in
tests/helpers/.

Every check compares minisrv against something computed independently of it: HF transformers models run in
float64 (greedy `generate`, teacher-forced logits), HF's logits processors, or hand computations.
"""
from __future__ import annotations

import os
from typing import Dict

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .helpers.tiny_models import (ARCHS, GPT_OSS_ARCHS, MOE_ARCHS, PHI_ARCHS, WINDOW_ARCHS,  # noqa: E402
                                  build_tiny_model)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(name) -> directory of a saved tiny checkpoint (built once per session)."""
    cache: Dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            path = str(tmp_path_factory.mktemp(f"tiny-{name}"))
            seed = (ARCHS + MOE_ARCHS + WINDOW_ARCHS + PHI_ARCHS + GPT_OSS_ARCHS).index(name) + 1
            cache[name] = build_tiny_model(path, name, seed=seed)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_qwen2_tools(tmp_path_factory) -> str:
    """Directory of a tiny random-weight Qwen2 with a Qwen2.5-style tool-calling chat template."""
    from .helpers.tiny_qwen2 import build_tiny_qwen2
    return build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2-tools")))


@pytest.fixture(scope="session")
def tiny_qwen3_thinking(tmp_path_factory) -> str:
    """Directory of a tiny random-weight Qwen3 whose tokenizer has <think> and </think> and a Qwen3-style template."""
    from .helpers.tiny_qwen3_thinking import build_tiny_qwen3_thinking
    return build_tiny_qwen3_thinking(str(tmp_path_factory.mktemp("tiny-qwen3-thinking")))


@pytest.fixture(scope="session")
def hardened_server():
    """A server with small limits (tests/helpers/http_wire.py), shared by the tests of the HTTP layer; stopped with
    SIGTERM after them, and its exit must be clean."""
    from .helpers.http_wire import HARDENED_SERVER_ARGS
    from .helpers.server_process import running
    with running(*HARDENED_SERVER_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def kernels():
    """The CPU block kernels (kernels/cpu_blocks.py); the test is skipped where they do not build."""
    from minisrv.kernels.cpu_blocks import BlockKernels
    k, how = BlockKernels.load()
    if k is None:
        pytest.skip(f"the CPU block kernels do not build here: {how}")
    return k


@pytest.fixture
def fake_fa(monkeypatch):
    """FA3's stand-in, and the fa backend allowed on this machine: an engine asked for fa builds its pool (windowed
    layers keeping only their window) and backend as on a GPU (without CUDA graphs)."""
    from minisrv.attention import BACKENDS, fa

    from .helpers import fake_fa3
    monkeypatch.setattr(fa, "load_kernel", lambda: fake_fa3.flash_attn_with_kvcache)
    monkeypatch.setitem(BACKENDS, "fa", (lambda sm: None, *BACKENDS["fa"][1:]))
    return fa
