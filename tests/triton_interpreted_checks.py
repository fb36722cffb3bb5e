"""The Triton kernels of the FP8 path run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before
Triton is imported: hence a script of its own, run by tests/test_triton_kernels_on_cpu.py in a fresh process).

What the interpreter can check here: the kernels' indexing, masking, tiling over K and the scaling arithmetic, for
FP8 operands and float16/float32 activations. Not everything: its bfloat16 matrix products and stores, its dot
products' precision and its float-to-e4m3 rounding are not the GPU's (see each check), and it runs programs one
after another, so split-K's arrival counting is checked for its logic, not for races: tests/gpu/ covers those.
Each check compares with the same arithmetic written out in torch (float64 for the GEMM). Prints one line per
check; raises AssertionError on the first failure.
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minisrv.models.fp8 import FP8, _triton_quant, quantize_rows  # noqa: E402
from minisrv.models.small_m_gemm import SmallMConfig, small_m_gemm  # noqa: E402


def check_small_m_gemm() -> None:
    """y = (xq * xs) (wq * ws)^T for FP8 operands: every row count up to a full tile and beyond the tile's rows
    (m = 1, 5, 16, 17, 33), output widths that are and are not multiples of the tile, K of 1 and several K steps,
    the tile shapes the H100's table uses (128 columns, K steps of 128 and 256), and K split over 2 and 4
    programs per column block (the last to arrive adds the others' partial sums), twice in a row."""
    run = small_m_gemm()
    assert run is not None, "Triton is missing"
    torch.manual_seed(0)
    for (n, k), config in [((96, 256), SmallMConfig(32, 128, 4, 3)), ((80, 512), SmallMConfig(16, 256, 2, 3)),
                           ((200, 256), SmallMConfig(128, 128, 8, 3)), ((64, 128), SmallMConfig(64, 128, 4, 4)),
                           ((96, 512), SmallMConfig(32, 128, 4, 3, split_k=2)),
                           ((80, 1024), SmallMConfig(16, 128, 4, 3, split_k=4))]:
        w = torch.randn(n, k) * 0.02
        wq, ws = quantize_rows(w)
        ws = ws.reshape(1, -1).contiguous()
        for m in (1, 5, 16, 17, 33):
            x = torch.randn(m, k)
            xq, xs = quantize_rows(x)
            y = run(xq, wq, xs=xs, ws=ws, config=config, raise_errors=True)
            if config.split_k > 1:  # split K: the arrival counters must be back at 0 for the next product
                again = run(xq, wq, xs=xs, ws=ws, config=config, raise_errors=True)
                assert torch.equal(again, y), f"{n}x{k} m={m} {tuple(config)}: a second product differs"
            ref = (xq.double() * xs.double()) @ (wq.double() * ws.double().t()).t()
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            err = ((y.double() - ref).abs() / ref.abs().max()).max().item()
            # the interpreter's dot is less exact than the GPU's float32 accumulation (errors of a few 1e-3 of the
            # largest output here): the bound is the GPU test's; a wrong index, mask or scale is off by O(1)
            assert err <= 1e-2, f"{n}x{k} m={m} {tuple(config)}: {err:.2e} from float64"
            print(f"small-M FP8 GEMM {n}x{k} m={m} {tuple(config)}: max error {err:.1e} of the largest output")


def check_gemv() -> None:
    """The one-row kernel (SmallMConfig.gemv, taken at m = 1) for FP8 and bf16 operands: column blocks narrower
    than the dot kernel's (4 and 8), output widths that are not multiples of them, one and several K steps, and K
    split over 2 and 4 programs per column block, twice in a row (the arrival counters back at 0). FP8 against float64 on the same rounded operands; bf16 against float64 on the bf16
    values (the interpreter rounds the float32 sum to bf16 as it stores)."""
    run = small_m_gemm()
    torch.manual_seed(2)
    for (n, k), config in [((90, 256), SmallMConfig(8, 256, 4, 1, gemv=True)),
                           ((37, 1024), SmallMConfig(4, 256, 4, 2, gemv=True)),
                           ((96, 512), SmallMConfig(16, 128, 4, 3, split_k=2, gemv=True)),
                           ((70, 2048), SmallMConfig(8, 512, 8, 3, split_k=4, gemv=True))]:
        w = torch.randn(n, k) * 0.02
        x = torch.randn(1, k)
        wq, ws = quantize_rows(w)
        ws = ws.reshape(1, -1).contiguous()
        xq, xs = quantize_rows(x)
        wb, xb = w.bfloat16(), x.bfloat16()
        for kind, product, ref in [
                ("fp8", lambda: run(xq, wq, xs=xs, ws=ws, config=config, raise_errors=True),
                 (xq.double() * xs.double()) @ (wq.double() * ws.double().t()).t()),
                ("bf16", lambda: run(xb, wb, config=config, raise_errors=True), xb.double() @ wb.double().t())]:
            y = product()
            assert y.shape == (1, n) and y.dtype == torch.bfloat16
            assert torch.equal(product(), y), f"{kind} {n}x{k} {tuple(config)}: a second product differs"
            err = ((y.double() - ref).abs() / ref.abs().max()).max().item()
            assert err <= 1e-2, f"{kind} {n}x{k} {tuple(config)}: {err:.2e} from float64"
            print(f"small-M GEMV {kind} {n}x{k} {tuple(config)}: max error {err:.1e} of the largest output")


def check_gemv_silu_mul() -> None:
    """The one-row kernel ending in SiLU-and-mul (run(..., silu_mul=True)) on a stacked gate and up weight: each
    output column's gate and up rows are the program's, also where the output width is not a multiple of the
    program's columns; against float64 with the gate and up sums rounded to bf16 first, as the kernel does.
    A configuration it cannot take (K split) is refused."""
    run = small_m_gemm()
    torch.manual_seed(3)
    for (inter, k), config in [((45, 256), SmallMConfig(16, 256, 4, 1, gemv=True)),
                               ((64, 1024), SmallMConfig(8, 256, 4, 2, gemv=True)),
                               ((37, 512), SmallMConfig(4, 512, 8, 3, gemv=True))]:
        w = (torch.randn(2 * inter, k) * 0.05).bfloat16()
        x = torch.randn(1, k).bfloat16()
        y = run(x, w, config=config, raise_errors=True, silu_mul=True)
        assert y.shape == (1, inter) and y.dtype == torch.bfloat16
        sums = (x.double() @ w.double().t()).bfloat16().double()
        gate, up = sums[:, :inter], sums[:, inter:]
        ref = gate * torch.sigmoid(gate) * up
        # the interpreter truncates to bf16 (up to one unit of bf16's last place, 2**-7 relative, at each of the
        # gate's, the up's and the output's roundings): each element within 3% of its own value (a wrong row,
        # column or mask is off by O(1))
        err = ((y.double() - ref).abs() / (ref.abs() + 1e-2 * ref.abs().max())).max().item()
        assert err <= 3e-2, f"{inter}x{k} {tuple(config)}: {err:.2e} from float64"
        print(f"small-M GEMV SiLU-and-mul {2 * inter}x{k} {tuple(config)}: max relative error {err:.1e}")
    try:
        run(x, w, config=SmallMConfig(8, 256, 4, 1, split_k=2, gemv=True), raise_errors=True, silu_mul=True)
    except ValueError:
        print("small-M GEMV SiLU-and-mul refuses split K")
    else:
        raise AssertionError("a SiLU-and-mul product with K split was not refused")


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
    """The three quantisers (plain; SiLU(gate) * up; residual add + RMSNorm, the residual written back through its
    own row stride) against the same steps in torch, rounding to the activations' dtype where the model does, for
    float16 and float32: the per-token scales (max |activation| / 448, so the activation's arithmetic at each row's
    largest element) and the residual. Not the e4m3 values themselves: the interpreter's float-to-e4m3 conversion
    mishandles a rounding that carries into the next power of two (124.7 became 64, not 128), so they are checked
    on the GPU (tests/gpu/test_fp8_weights.py) against torch's conversion."""
    fused = _triton_quant()
    assert fused is not None
    torch.manual_seed(1)
    for dtype in (torch.float16, torch.float32):
        for t, n in ((1, 64), (3, 96), (4, 1000)):
            x = (torch.randn(t, n) * 3).to(dtype)
            q, s = fused.quant(x)
            assert q.dtype == FP8 and q.shape == (t, n) and s.shape == (t, 1)
            torch.testing.assert_close(s, quantize_rows(x)[1], rtol=1e-6, atol=0)

            gu = torch.randn(t, 2 * n).to(dtype)
            g, u = gu.float().chunk(2, dim=-1)
            act = (g / (1 + torch.exp(-g)) * u).to(dtype)
            q, s = fused.silu_mul_quant(gu)
            assert q.shape == (t, n)
            torch.testing.assert_close(s, quantize_rows(act)[1], rtol=1e-5, atol=0)

            weight = (torch.rand(n) + 0.5).to(dtype)
            residual = torch.randn(t, 2 * n).to(dtype)[:, :n]  # a row stride that is not n
            expect_sum = (x.float() + residual.float()).to(dtype)
            h = expect_sum.float()
            normed = ((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
                      * weight.float()).to(dtype)
            q, s = fused.add_norm_quant(x, residual, weight, 1e-6)
            assert torch.equal(residual, expect_sum), f"residual {dtype} {t}x{n}"
            torch.testing.assert_close(s, quantize_rows(normed)[1], rtol=1e-5, atol=0)
            print(f"fused quantisers {dtype} {t}x{n}: scales and residual as torch")


if __name__ == "__main__":
    check_small_m_gemm()
    check_gemv()
    check_gemv_silu_mul()
    check_row_argmax()
    check_rope_and_store()
    check_fused_quantisers()
    print("ok")
