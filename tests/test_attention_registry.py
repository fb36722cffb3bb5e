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
ALL_PACKAGES = {"flashinfer", "sgl_kernel", "flash_attn_interface", "triton"}


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
    fake(90, packages={"flashinfer", "triton"})
    with caplog.at_level(logging.INFO, logger="minisrv.attention"):
        assert resolve_backend("auto", CUDA) == "fi"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "fa,fi" in warnings[0] and "sgl-kernel" in warnings[0] and "falling back to fi" in warnings[0]


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
    fake(90, packages={"flashinfer", "flash_attn_interface", "triton"})
    assert resolve_backend("auto", CUDA) == "fa,fi"


def test_auto_on_old_gpu_is_torch(fake):
    fake(70)
    assert resolve_backend("auto", CUDA) == "torch"


@pytest.mark.parametrize("name", ["torch", "fa", "fi", "fa,fi", "fi,fa", "torch,fi", "fi,torch", "fa,triton",
                                  "fi,triton"])
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


@pytest.mark.parametrize("name", ["triton", "triton,fi", "triton,triton"])
def test_triton_is_a_decode_half_only(fake, name):
    fake(90)
    with pytest.raises(ValueError, match="decode steps only.*fa,triton"):
        resolve_backend(name, CUDA)


def test_triton_decode_half_needs_cuda_sm80_and_triton(fake):
    fake(90, packages=ALL_PACKAGES - {"triton"})
    with pytest.raises(BackendUnavailable, match="pip install triton"):
        resolve_backend("fa,triton", CUDA)
    fake(75)
    assert "SM80" in missing("torch,triton", 75)
    fake(None)
    assert "CUDA" in missing("torch,triton", None)


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


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------------------------------------
# fi's decode over an FP8 pool: the xqa backend, through the stand-in FlashInfer and a float64 stand-in for XQA

def _stand_in_xqa(q, kv, workspace, page_table, seq_lens, max_seq_len, bmm1_scale, bmm2_scale, kv_layout="NHD"):
    """XQA's semantics in float64: request b's keys are the first seq_lens[b] slots of its pages in table order; the
    softmax of q.k * bmm1_scale weights V, times bmm2_scale (K and V read as stored, in e4m3 units)."""
    assert kv_layout == "NHD" and q.is_contiguous() and seq_lens.dtype == torch.uint32
    k_cache, v_cache = kv
    ps, hkv, d = k_cache.shape[1:]
    assert max_seq_len == page_table.shape[1] * ps  # the table's width in tokens
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens.view(torch.int32).tolist()):
        pages = page_table[b, :(n + ps - 1) // ps].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:n].double().repeat_interleave(q.shape[1] // hkv, dim=1)
        v = v_cache[pages].reshape(-1, hkv, d)[:n].double().repeat_interleave(q.shape[1] // hkv, dim=1)
        p = (torch.einsum("hd,khd->hk", q[b].double(), k) * bmm1_scale).softmax(-1)
        out[b] = (torch.einsum("hk,khd->hd", p, v) * bmm2_scale).to(q.dtype)
    return out


@pytest.fixture
def fp8_fi(monkeypatch):
    """The stand-in FlashInfer (tests/helpers/fake_flashinfer.py), with XQA's decode function where `xqa` is true,
    and an FP8 pool of pages of 16 on the CPU with per-layer scales other than 1.0."""
    import types
    from minisrv.kvcache import KVPool
    from tests.helpers import fake_flashinfer

    def apply(xqa: bool):
        decode = types.ModuleType("flashinfer.decode")
        if xqa:
            decode.xqa_batch_decode_with_kv_cache = _stand_in_xqa
        monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
        monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
        from minisrv.attention import fi, xqa as xqa_module
        monkeypatch.setattr(fi, "WORKSPACE_BYTES", 1024)
        monkeypatch.setattr(xqa_module, "SEMAPHORE_BYTES", 64)
        monkeypatch.setattr(xqa_module, "SCRATCH_BYTES", 64)
        # XQA runs on Hopper only: here the device checks are what is pretended, and there is no stream to wait on
        monkeypatch.setattr(xqa_module.XQADecodeBackend, "usable",
                            staticmethod(lambda pool, device: xqa and pool.quantized and pool.page_size == 16))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        pool = KVPool(2, 8, 16, 2, 8, torch.float32, CPU, torch.float8_e4m3fn)
        pool.set_scales([0.75, 1.5], [1.25, 0.625])
        return pool, torch.arange(128, dtype=torch.int32).view(2, 64)

    return apply


def test_fi_over_an_fp8_pool_decodes_on_xqa_and_matches_torch(fp8_fi):
    """`auto` and `xqa` give fi's decode steps to the xqa backend (its extend steps stay on fi), whose output over
    the FP8 pool, scales included, is the torch backend's; `flashinfer` keeps fi whole."""
    from minisrv.attention import create_backend
    from minisrv.attention.fi import FlashInferBackend
    from minisrv.attention.torch_native import TorchNativeBackend
    from minisrv.attention.xqa import XQADecodeBackend
    from minisrv.batch import ForwardBatch, ForwardMode

    pool, table = fp8_fi(xqa=True)
    assert isinstance(create_backend("fi", pool, table, 4, "flashinfer"), FlashInferBackend)
    for kernel in ("auto", "xqa"):
        backend = create_backend("fi", pool, table, 4, kernel)
        assert isinstance(backend.prefill_backend, FlashInferBackend)
        assert isinstance(backend.decode_backend, XQADecodeBackend) and backend.supports_cuda_graph
    torch.manual_seed(0)
    lens = [20, 37]  # request 0 on row 0 (pages 0-1), request 1 on row 1 (pages 4-6), each counting its new token
    for layer in range(2):
        pool.store(layer, torch.cat([torch.arange(19), 64 + torch.arange(36)]), torch.randn(55, 2, 8),
                   torch.randn(55, 2, 8))
    loc = torch.tensor([19, 64 + 36])
    dec = ForwardBatch(ForwardMode.DECODE, torch.zeros(2, dtype=torch.int64), torch.tensor(lens) - 1, loc,
                       torch.tensor([0, 1]), torch.tensor(lens, dtype=torch.int32),
                       torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 1]), lens, [1, 1], max(lens))
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    ref_pool = copy_pool(pool)
    out = [backend.step(dec)(q, k, v, layer) for layer in range(2)]
    ref = [TorchNativeBackend(ref_pool, table, 4).step(dec)(q, k, v, layer) for layer in range(2)]
    for layer in range(2):
        assert torch.allclose(out[layer], ref[layer], atol=1e-5), f"layer {layer}"
        assert torch.equal(pool.kv[layer].view(torch.uint8), ref_pool.kv[layer].view(torch.uint8))


def copy_pool(pool):
    from minisrv.kvcache import KVPool
    other = KVPool(pool.num_layers, pool.num_pages, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype,
                   pool.device, pool.kv_dtype)
    other.set_scales(pool.k_scale_host, pool.v_scale_host)
    for mine, theirs in zip(other.kv, pool.kv):
        mine.view(torch.uint8).copy_(theirs.view(torch.uint8))
    return other


def test_fi_over_an_fp8_pool_where_xqa_cannot_run(fp8_fi, caplog):
    """Where XQA cannot run, `xqa` is a clear error and `auto` keeps FlashInfer's wrappers; where it fails to load,
    `xqa` raises that failure and `auto` logs it and keeps the wrappers."""
    from minisrv.attention import create_backend
    from minisrv.attention.fi import FlashInferBackend

    pool, table = fp8_fi(xqa=False)
    with pytest.raises(ValueError, match="xqa FP8 decode kernel needs an SM 9.x GPU"):
        create_backend("fi", pool, table, 4, "xqa")
    assert isinstance(create_backend("fi", pool, table, 4, "auto"), FlashInferBackend)
    pool, table = fp8_fi(xqa=True)
    del sys.modules["flashinfer.decode"].xqa_batch_decode_with_kv_cache
    with pytest.raises(ImportError):
        create_backend("fi", pool, table, 4, "xqa")
    with caplog.at_level(logging.WARNING, logger="minisrv.attention.xqa"):
        assert isinstance(create_backend("fi", pool, table, 4, "auto"), FlashInferBackend)
    assert "XQA decode kernel unavailable (ImportError" in caplog.text


def test_xqa_is_not_given_a_windowed_or_soft_capped_model(fp8_fi):
    """XQA serves neither windows nor soft-capping: `xqa` refuses such a model, `auto` keeps FlashInfer's wrappers."""
    from minisrv.attention import create_backend
    from minisrv.attention.fi import FlashInferBackend
    from minisrv.models.attention_options import LayerAttention

    pool, table = fp8_fi(xqa=True)
    for layers in ((LayerAttention(0.3, window=8), LayerAttention(0.3)), (LayerAttention(0.3, softcap=5.0),) * 2):
        with pytest.raises(ValueError, match="xqa FP8 decode kernel does not serve"):
            create_backend("fi", pool, table, 4, "xqa", layers)
        assert isinstance(create_backend("fi", pool, table, 4, "auto", layers), FlashInferBackend)
