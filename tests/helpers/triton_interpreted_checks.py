"""The Triton kernels of the FP8 path run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before
Triton is imported: hence a script of its own, run by tests/test_triton_kernels_on_cpu.py in a fresh process).

What the interpreter can check here: the kernels' indexing, masking, tiling over K and the scaling arithmetic, for
FP8 operands and float16/float32 activations. Not everything: its bfloat16 matrix products and stores, its dot
products' precision and its float-to-e4m3 rounding are not the GPU's (see each check). Each check compares with
the torch reference beside the kernel (float64 for the GEMM) or the same arithmetic written out in torch. Prints
one line per check; raises AssertionError on the first failure.
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minisrv.kernels.fp8_gemm import GemmConfig, dequantized_matmul, small_m_fp8_gemm  # noqa: E402
from minisrv.kernels.fp8_quant import (FP8, add_norm_reference, quantize_rows, silu_mul_reference,  # noqa: E402
                                       triton_quantisers)
from minisrv.kernels.qk_rope_store import reference as qk_rope_store_reference  # noqa: E402
from minisrv.kernels.qk_rope_store import triton_qk_rope_store  # noqa: E402
from minisrv.models.layers import RotaryEmbedding  # noqa: E402
from minisrv.models.norms import RMSNorm  # noqa: E402


def check_small_m_fp8_gemm() -> None:
    """y = (xq * xs) (wq * ws)^T for FP8 operands (kernels/fp8_gemm.py) against its torch reference in float64:
    every row count up to a full tile and beyond the tile's rows (m = 1, 5, 16, 17, 33), output widths that are and
    are not multiples of the tile, K of one and several K steps, the tile shapes the launch rules use (16 to 128
    columns, K steps of 128 and 256)."""
    run = small_m_fp8_gemm()
    assert run is not None, "Triton is missing"
    torch.manual_seed(0)
    for (n, k), config in [((96, 256), GemmConfig(32, 128, 4, 3)), ((80, 512), GemmConfig(16, 256, 2, 3)),
                           ((200, 256), GemmConfig(128, 128, 8, 3)), ((64, 128), GemmConfig(64, 128, 4, 4))]:
        w = torch.randn(n, k) * 0.02
        wq, ws = quantize_rows(w)
        ws = ws.reshape(1, -1).contiguous()
        for m in (1, 5, 16, 17, 33):
            x = torch.randn(m, k)
            xq, xs = quantize_rows(x)
            y = run(xq, xs, wq, ws, config=config, raise_errors=True)
            ref = dequantized_matmul(xq, xs, wq, ws, torch.float64)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            err = ((y.double() - ref).abs() / ref.abs().max()).max().item()
            # the interpreter's dot is less exact than the GPU's float32 accumulation (errors of a few 1e-3 of the
            # largest output here): the bound is the GPU test's; a wrong index, mask or scale is off by O(1)
            assert err <= 1e-2, f"{n}x{k} m={m} {tuple(config)}: {err:.2e} from float64"
            print(f"small-M FP8 GEMM {n}x{k} m={m} {tuple(config)}: max error {err:.1e} of the largest output")


def check_fused_quantisers() -> None:
    """The three quantisers (kernels/fp8_quant.py: plain; SiLU(gate) * up; residual add + RMSNorm, the residual
    written back through its own row stride) against their torch references, for float16 and float32: the
    per-token scales (max |activation| / 448, so the activation's arithmetic at each row's largest element) and
    the residual. Not the e4m3 values themselves: the interpreter's float-to-e4m3 conversion mishandles a rounding
    that carries into the next power of two (124.7 became 64, not 128), so they are checked on the GPU
    (tests/gpu/test_fp8_weights.py) against torch's conversion."""
    fused = triton_quantisers()
    assert fused is not None
    torch.manual_seed(1)
    for dtype in (torch.float16, torch.float32):
        for t, n in ((1, 64), (3, 96), (4, 1000)):
            x = (torch.randn(t, n) * 3).to(dtype)
            q, s = fused.quant(x)
            assert q.dtype == FP8 and q.shape == (t, n) and s.shape == (t, 1)
            torch.testing.assert_close(s, quantize_rows(x)[1], rtol=1e-6, atol=0)

            gu = torch.randn(t, 2 * n).to(dtype)
            q, s = fused.silu_mul_quant(gu)
            assert q.shape == (t, n)
            torch.testing.assert_close(s, quantize_rows(silu_mul_reference(gu))[1], rtol=1e-5, atol=0)

            weight = (torch.rand(n) + 0.5).to(dtype)
            residual = torch.randn(t, 2 * n).to(dtype)[:, :n]  # a row stride that is not n
            expect_residual = residual.clone()
            normed = add_norm_reference(x, expect_residual, weight, 1e-6)
            q, s = fused.add_norm_quant(x, residual, weight, 1e-6)
            assert torch.equal(residual, expect_residual), f"residual {dtype} {t}x{n}"
            torch.testing.assert_close(s, quantize_rows(normed)[1], rtol=1e-5, atol=0)
            print(f"fused quantisers {dtype} {t}x{n}: scales and residual as torch")


def check_qk_rope_store() -> None:
    """The attention layer's fused q/k norm + rotary + KV store (kernels/qk_rope_store.py), on a qkv output whose
    rows are strided (a view into a wider buffer), into a paged pool at scattered slots, with and without the norms
    (Qwen3 / Llama), head counts that are and are not powers of two: against its torch reference (the same
    roundings: equal up to one float16 rounding), and that reference against the layers' own torch path (RMSNorm
    and RotaryEmbedding modules, HF's roundings) within float16's error. Slots not written stay as they were."""
    run = triton_qk_rope_store()
    assert run is not None
    torch.manual_seed(2)
    d, eps = 64, 1e-6
    rotary = RotaryEmbedding(d, 512, 10000.0, None)
    for dtype in (torch.float16, torch.float32):
        for hq, hkv, t, norm in ((4, 2, 1, True), (6, 3, 5, True), (8, 1, 7, False)):
            width = (hq + 2 * hkv) * d
            qkv = torch.randn(t, width + 40).to(dtype)[:, :width]
            positions = torch.randint(0, 512, (t,))
            qw = kw = None
            if norm:
                qw, kw = (torch.rand(d) + 0.5).to(dtype), (torch.rand(d) + 0.5).to(dtype)
            pool = torch.randn(2, 6, 4, hkv, d).to(dtype)  # [2, pages, page size, Hkv, D]
            slots = torch.randperm(24)[:t]
            got_qkv, got_pool = qkv.clone(), pool.clone()
            run(got_qkv, positions, rotary.cos_sin, hq, hkv, d, qw, kw, eps, got_pool, slots)
            ref_qkv, ref_pool = qkv.clone(), pool.clone()
            qk_rope_store_reference(ref_qkv, positions, rotary.cos_sin, hq, hkv, d, qw, kw, eps, ref_pool, slots)
            tol = 1e-3 if dtype == torch.float16 else 1e-5
            torch.testing.assert_close(got_qkv, ref_qkv, rtol=tol, atol=tol)
            torch.testing.assert_close(got_pool, ref_pool, rtol=tol, atol=tol)
            untouched = torch.ones(24, dtype=torch.bool)
            untouched[slots] = False
            assert torch.equal(got_pool.view(2, 24, hkv, d)[:, untouched], pool.view(2, 24, hkv, d)[:, untouched])
            # the layers' torch path: RMSNorm modules (HF's roundings) and the rotary's torch rotation
            q = qkv[:, :hq * d].reshape(t, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
            if norm:
                qn, kn = RMSNorm(d, eps), RMSNorm(d, eps)
                qn.weight.data, kn.weight.data = qw, kw
                q = qn(q.reshape(-1, d)).view(t, hq, d)
                k = kn(k.reshape(-1, d)).view(t, hkv, d)
            q, k = rotary(positions, q.to(dtype), k.to(dtype))
            layer_tol = 4e-3 if dtype == torch.float16 else 1e-5
            torch.testing.assert_close(got_qkv[:, :hq * d].view(t, hq, d), q, rtol=layer_tol, atol=layer_tol)
            torch.testing.assert_close(got_pool.view(2, 24, hkv, d)[0, slots], k, rtol=layer_tol, atol=layer_tol)
            torch.testing.assert_close(got_pool.view(2, 24, hkv, d)[1, slots], qkv[:, (hq + hkv) * d:].view(t, hkv, d))
            print(f"q/k norm + rotary + store {dtype} hq {hq} hkv {hkv} t {t} norm {norm}: as torch")


if __name__ == "__main__":
    check_small_m_fp8_gemm()
    check_fused_quantisers()
    check_qk_rope_store()
    print("ok")
