"""Choosing an attention backend: `auto` by SM version with fallbacks, explicit choices, names; CPU only."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minisrv.attention as attn
from minisrv.attention import BackendUnavailable, auto_choice, canonical, missing, resolve_backend

CUDA = torch.device("cuda")  # constructing a device object needs no GPU
CPU = torch.device("cpu")
ALL_PACKAGES = {"flashinfer", "sgl_kernel", "flash_attn_interface"}


@pytest.fixture
def fake(monkeypatch):
    """fake(sm, packages): pretend the GPU is SM `sm` (None: no CUDA) and only `packages` are installed."""

    def apply(sm, packages=ALL_PACKAGES):
        present = set(packages)
        monkeypatch.setattr(attn, "device_sm", lambda device=None: sm)
        monkeypatch.setattr(attn, "_package_present", lambda module: module in present)

    return apply


@pytest.mark.parametrize("sm,expected", [(100, "fi"), (120, "fi"), (90, "fa,fi"), (89, "fi"), (86, "fi"),
                                         (80, "fi"), (None, "torch")])
def test_auto_choice(sm, expected):
    assert auto_choice(sm) == expected


@pytest.mark.parametrize("sm,expected", [(100, "fi"), (90, "fa,fi"), (89, "fi"), (80, "fi")])
def test_auto_resolves_by_sm(fake, sm, expected):
    fake(sm)
    assert resolve_backend("auto", CUDA) == expected


def test_auto_without_cuda_is_torch(fake):
    fake(None, packages=())
    assert resolve_backend("auto", CUDA) == "torch"
    fake(90)  # a CPU device never asks for the SM
    assert resolve_backend("auto", CPU) == "torch"


def test_auto_sm90_without_fa3_falls_back_to_fi(fake, caplog):
    fake(90, packages={"flashinfer"})
    with caplog.at_level(logging.INFO, logger="minisrv.attention"):
        assert resolve_backend("auto", CUDA) == "fi"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "fa,fi" in msg and "sgl-kernel" in msg and "falling back to fi" in msg


def test_auto_sm90_without_anything_falls_back_to_torch(fake, caplog):
    fake(90, packages=())
    with caplog.at_level(logging.WARNING, logger="minisrv.attention"):
        assert resolve_backend("auto", CUDA) == "torch"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "falling back to fi" in text and "falling back to torch" in text
    assert "flashinfer-python" in text


def test_auto_sm100_without_flashinfer_is_torch(fake, caplog):
    fake(100, packages={"sgl_kernel"})
    with caplog.at_level(logging.WARNING, logger="minisrv.attention"):
        assert resolve_backend("auto", CUDA) == "torch"
    assert "flashinfer-python" in caplog.text


def test_auto_sm90_with_upstream_fa3_only(fake):
    fake(90, packages={"flashinfer", "flash_attn_interface"})
    assert resolve_backend("auto", CUDA) == "fa,fi"


def test_auto_on_old_gpu_is_torch(fake):
    fake(70)
    assert resolve_backend("auto", CUDA) == "torch"


@pytest.mark.parametrize("name", ["torch", "fa", "fi", "fa,fi", "fi,fa", "torch,fi", "fi,torch"])
def test_explicit_available(fake, name):
    fake(90)
    assert resolve_backend(name, CUDA) == name


def test_explicit_torch_needs_nothing(fake):
    fake(None, packages=())
    assert resolve_backend("torch", CPU) == "torch"
    assert resolve_backend("torch", CUDA) == "torch"


def test_explicit_fa_without_package(fake):
    fake(90, packages={"flashinfer"})
    with pytest.raises(BackendUnavailable, match="sgl-kernel"):
        resolve_backend("fa", CUDA)


def test_explicit_fa_on_sm80(fake):
    fake(80)
    with pytest.raises(BackendUnavailable, match="SM90") as info:
        resolve_backend("fa", CUDA)
    assert "SM80" in str(info.value)


def test_explicit_fi_without_cuda(fake):
    fake(None)
    with pytest.raises(BackendUnavailable, match="CUDA"):
        resolve_backend("fi", CPU)
    with pytest.raises(BackendUnavailable, match="CUDA"):
        resolve_backend("fi", CUDA)


def test_explicit_fi_without_package(fake):
    fake(89, packages={"sgl_kernel"})
    with pytest.raises(BackendUnavailable, match="flashinfer-python"):
        resolve_backend("fi", CUDA)


def test_hybrid_reports_the_missing_half(fake):
    fake(90, packages={"sgl_kernel"})
    with pytest.raises(BackendUnavailable, match="flashinfer-python"):
        resolve_backend("fa,fi", CUDA)
    fake(80)
    with pytest.raises(BackendUnavailable, match="SM90"):
        resolve_backend("fi,fa", CUDA)


@pytest.mark.parametrize("name", ["xyz", "fa,fi,torch", "", "fa,", ",fi", "flashinfer", "FA"])
def test_unknown_names(fake, name):
    fake(90)
    with pytest.raises(ValueError):
        resolve_backend(name, CUDA)
    with pytest.raises(ValueError):
        missing(name, 90)


def test_canonical_names(fake):
    assert canonical("fa,fa") == "fa"
    assert canonical("fi, fi") == "fi"
    assert canonical(" fa , fi ") == "fa,fi"
    assert canonical("torch") == "torch"
    fake(90)
    assert resolve_backend("fa,fa", CUDA) == "fa"
    assert resolve_backend("fi,fi", CUDA) == "fi"


def test_missing(fake):
    fake(90)
    assert missing("fa,fi", 90) is None
    assert missing("torch", None) is None
    assert "SM90" in missing("fa", 89)
    assert "CUDA" in missing("fi", None)
    fake(90, packages=())
    assert "sgl-kernel" in missing("fa,fi", 90)
    assert "flashinfer-python" in missing("fi", 90)


def test_import_pulls_in_no_gpu_library():
    root = Path(__file__).resolve().parents[1]
    code = ("import sys, minisrv.attention, minisrv.attention.base, minisrv.attention.torch_native\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('flashinfer', 'sgl_kernel', 'flash_attn_interface', 'flash_attn_3')]\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported GPU libraries: {out.stdout.strip()}"


def test_explicit_fa_on_sm100(fake):
    """FlashAttention-3 is a Hopper kernel: Blackwell gets a clear error, not a failed launch."""
    fake(100)
    with pytest.raises(BackendUnavailable, match="SM90") as info:
        resolve_backend("fa", CUDA)
    assert "SM100" in str(info.value)


def test_hybrid_routes_extend_to_prefill_half_and_decode_to_decode_half():
    """A P,D hybrid: prefill/extend steps plan and run on P, decode steps (and CUDA-graph hooks) on D; the result
    equals the torch backend's either way (both halves are torch backends here, told apart by a spy)."""
    import torch
    from minisrv.attention.base import HybridBackend
    from minisrv.batch import ForwardBatch, ForwardMode
    from minisrv.attention.torch_native import TorchNativeBackend
    from minisrv.kvcache import KVPool

    calls = []

    class Spy(TorchNativeBackend):
        def __init__(self, tag, *a):
            super().__init__(*a)
            self.name = tag

        def prepare(self, b):
            calls.append((self.name, "prepare", b.mode.value))
            return super().prepare(b)

        def forward(self, q, k, v, layer_id, meta):
            calls.append((self.name, "forward"))
            return super().forward(q, k, v, layer_id, meta)

        def init_graph_state(self, max_bs, max_seq_len):
            calls.append((self.name, "init_graph_state"))

    pool = KVPool(1, 16, 1, 2, 8, torch.float32, torch.device("cpu"))
    table = torch.arange(16, dtype=torch.int32)[None, :]
    hybrid = HybridBackend(Spy("P", pool, table, 4), Spy("D", pool, table, 4))
    assert hybrid.name == "P,D"
    t = 5
    ext = ForwardBatch(ForwardMode.EXTEND, torch.zeros(t, dtype=torch.int64), torch.arange(t), torch.arange(t),
                       torch.zeros(1, dtype=torch.int64), torch.tensor([t], dtype=torch.int32),
                       torch.tensor([0, t], dtype=torch.int32), torch.tensor([t - 1]), [t], [t], t)
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    out = hybrid.step(ext)(q, k, v, 0)
    dec = ForwardBatch(ForwardMode.DECODE, torch.zeros(1, dtype=torch.int64), torch.tensor([t]), torch.tensor([t]),
                       torch.zeros(1, dtype=torch.int64), torch.tensor([t + 1], dtype=torch.int32),
                       torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0]), [t + 1], [1], t + 1)
    hybrid.step(dec)(torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8), 0)
    hybrid.init_graph_state(8, 16)
    assert calls == [("P", "prepare", "extend"), ("P", "forward"), ("D", "prepare", "decode"), ("D", "forward"),
                     ("D", "init_graph_state")]
    # the extend output is plain causal attention over the 5 tokens (GQA: q heads 2i, 2i+1 read kv head i)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / 8 ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    assert torch.allclose(out, ref, atol=1e-5)
