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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minisrv.kernels.fp8_gemm import GemmConfig, dequantized_matmul, small_m_fp8_gemm  # noqa: E402
from minisrv.kernels.fp8_quant import (FP8, add_norm_reference, quantize_rows, silu_mul_reference,  # noqa: E402
                                       triton_quantisers)


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


def check_row_argmax() -> None:
    """Greedy decoding's two-kernel argmax (engine/argmax_kernel.py) against torch's: several rows, widths that are
    and are not multiples of its block (one block, many), float32 / bf16 / float16, rows that are views with a
    longer stride, a maximum tied within a block and across blocks (the lowest index wins, as torch's), a row of
    -inf (index 0, as torch's)."""
    from minisrv.engine.argmax_kernel import BLOCK, row_argmax
    torch.manual_seed(4)
    for rows, vocab in [(1, 100), (3, 3 * BLOCK), (2, 2 * BLOCK + 7)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            wide = torch.randn(rows, vocab + 5).to(dtype)
            logits = wide[:, :vocab]  # rows not contiguous with each other
            top = logits.max()
            logits[0, vocab - 1] = top + 1  # row 0: the maximum in the last, partial block, then tied earlier
            logits[0, vocab // 3] = top + 1
            if rows > 1:
                logits[1] = float("-inf")
            if rows > 2:
                logits[2, BLOCK + 3] = logits[2, BLOCK + 9] = top + 2  # tied within one block
            got = row_argmax(logits)
            assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1)), (
                f"{rows}x{vocab} {dtype}: {got.tolist()} against torch's {logits.argmax(dim=-1).tolist()}")
            print(f"row argmax {rows}x{vocab} {dtype}: as torch's")


def check_rope_and_store() -> None:
    """The fused rotary + K/V store (kvcache/rope_store_kernel.py) against the model's torch rotary then the pool's
    store: q and k rotated in place (strided views of one qkv row, as the model passes them), k and v at their
    slots of the layer, nothing else of the pool touched; float32 and float16, GQA and MQA, head_dim 64 and 128,
    positions far into the cos/sin table."""
    from minisrv.kvcache.pool import KVPool
    from minisrv.kvcache.rope_store_kernel import rope_and_store
    from minisrv.models.layers import RotaryEmbedding
    torch.manual_seed(3)
    for dtype, (hq, hkv, d), t in [(torch.float32, (8, 2, 64), 5), (torch.float16, (4, 1, 128), 3),
                                   (torch.float32, (6, 6, 64), 1)]:
        rope = RotaryEmbedding(d, 4096, 500000.0, None)
        pools = [KVPool(2, 8, 4, hkv, d, dtype, torch.device("cpu")) for _ in range(2)]
        for kv, same in zip(pools[0].kv, pools[1].kv):
            kv.copy_(torch.randn(kv.shape))
            same.copy_(kv)
        qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
        views = lambda x: x.split([hq * d, hkv * d, hkv * d], dim=-1)  # noqa: E731
        positions = torch.randint(0, 4096, (t,))
        loc = torch.randperm(32)[:t]
        mine = qkv.clone()
        q, k, v = (x.view(t, -1, d) for x in views(mine))
        rope_and_store(q, k, v, pools[0].kv[1], positions, loc, rope.cos_sin)
        ref = qkv.clone()
        rq, rk, rv = (x.view(t, -1, d) for x in views(ref))
        rq, rk = rope(positions, rq, rk)
        pools[1].store(1, loc, rk, rv)
        torch.testing.assert_close(q, rq, rtol=0, atol=1e-6)
        torch.testing.assert_close(k, rk, rtol=0, atol=1e-6)
        torch.testing.assert_close(pools[0].kv[1], pools[1].kv[1], rtol=0, atol=1e-6)
        assert torch.equal(pools[0].kv[0], pools[1].kv[0]), "another layer was written"
        print(f"rope and store {dtype} {hq}/{hkv} heads of {d}, {t} tokens: as the torch rotary then the store")


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


if __name__ == "__main__":
    check_small_m_fp8_gemm()
    check_row_argmax()
    check_rope_and_store()
    check_fused_quantisers()
    print("ok")
