"""The fused experts' Triton kernels (minisrv/kernels/moe_align.py, moe_gemm.py, driven by fused_moe.py's
triton_experts) run by Triton's interpreter on the CPU; run as a script by tests/test_fused_moe.py, in a fresh
process, because the interpreter must be switched on before Triton is imported.

What the interpreter checks here: the alignment's outputs (every pair once, groups padded to BLOCK_M, each block's
expert), and the grouped GEMMs' gathering of rows by pair, expert offsets, masks (rows, columns, K), SiLU-and-mul in
the epilogue, the FP8 scales and the routing weights, against experts_reference, for float16 activations (the
interpreter's bfloat16 products are not the GPU's: see triton_interpreted_checks.py) and FP8 weights, with the three
launch configurations of config_for's rule. Prints one line per check and "ok" at the end; raises AssertionError
on the first failure.

`check_alignment` (the invariants) is also imported by tests/test_fused_moe.py for the torch alignment; importing
this module does not switch the interpreter on (only running it does).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minisrv.kernels.moe_align import Aligned, max_padded  # noqa: E402

FP16_BOUND = 2e-3  # of the largest output: float32 accumulation, float16 roundings (2^-11 each)
FP8_NORM_BOUND = 4e-2  # of the output's norm, FP8 against experts_reference (see check_fused_experts)


def check_alignment(aligned: Aligned, topk_ids: torch.Tensor, num_experts: int, block_m: int) -> int:
    """Asserts the alignment's invariants; returns the padded total. Every pair t * k + j appears once in
    sorted_pairs[:total]; each expert's pairs fill ceil(count / block_m) consecutive blocks, padding (= T*k) only
    after them; expert_ids names each block's expert, in increasing order, and -1 past the total."""
    flat = topk_ids.reshape(-1).long().cpu()
    n = flat.numel()
    sorted_pairs = aligned.sorted_pairs.cpu().long()
    expert_ids = aligned.expert_ids.cpu().long()
    total = int(aligned.num_padded.reshape(-1)[0])
    size = max_padded(n, num_experts, block_m)
    assert sorted_pairs.numel() == size and expert_ids.numel() == size // block_m, (sorted_pairs.shape, size)
    assert total % block_m == 0 and total <= size, (total, size)
    used = sorted_pairs[:total]
    real = used[used < n]
    assert torch.equal(real.sort().values, torch.arange(n)), "a pair is missing or repeated"
    assert bool((used <= n).all()), "an entry past T*k"
    blocks = expert_ids[:total // block_m]
    assert bool((expert_ids[total // block_m:] == -1).all()), "expert ids past the total"
    assert bool((blocks[1:] > blocks[:-1]).logical_or(blocks[1:] == blocks[:-1]).all()), "blocks out of order"
    counts = torch.bincount(flat, minlength=num_experts)
    for e in range(num_experts):
        rows = used.view(-1, block_m)[blocks == e].reshape(-1)
        assert rows.numel() == -(-int(counts[e]) // block_m) * block_m, f"expert {e}: {rows.numel()} rows"
        c = int(counts[e])
        assert bool((rows[:c] < n).all()) and bool((rows[c:] == n).all()), f"expert {e}: padding not at the end"
        assert bool((flat[rows[:c]] == e).all()), f"expert {e}: a pair of another expert"
    return total


def routing(t: int, num_experts: int, top_k: int, seed: int):
    """Random top-k routing (ids int32, renormalised float32 weights, as route() gives them): where top_k <
    num_experts, over experts [0, num_experts - 1), so that the last expert never gets a token (with few tokens
    others get none either)."""
    g = torch.Generator().manual_seed(seed)
    pool = num_experts - 1 if top_k < num_experts else num_experts
    ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(t)]).int()
    weights = torch.rand(t, top_k, generator=g) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def experts_inputs(t: int, h: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype, fp8: bool,
                   seed: int):
    """x, w13, w2, weights, ids[, w13_scale, w2_scale] for a random MoE layer (FP8: weights quantised per row).
    Each weight row is scaled by its own factor in [1/4, 4], so that a scale read for the wrong row, column or
    expert is off by O(1)."""
    from minisrv.kernels.fp8_quant import quantize_rows
    g = torch.Generator().manual_seed(seed)

    def rows(*shape):
        spread = 4 ** (2 * torch.rand(*shape[:-1], 1, generator=g) - 1)
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5 * spread
    x = torch.randn(t, h, generator=g).to(dtype)
    w13, w2 = rows(num_experts, 2 * inter, h).to(dtype), rows(num_experts, h, inter).to(dtype)
    weights, ids = routing(t, num_experts, top_k, seed)
    if not fp8:
        return x, w13, w2, weights, ids
    q13, s13 = quantize_rows(w13.reshape(-1, h))
    q2, s2 = quantize_rows(w2.reshape(-1, inter))
    return (x, q13.view(num_experts, 2 * inter, h), q2.view(num_experts, h, inter), weights, ids,
            s13.view(num_experts, 2 * inter), s2.view(num_experts, h))


def check_align_kernel() -> None:
    """The alignment kernel, in one launch and in its three: token counts from 1 to past one CHUNK (1,024 pairs),
    one to many PIECEs (64 pairs), block counts past one BLOCKS step (64), 4, 8 and 128 experts (one never hit),
    blocks of 16 and 64 rows. The one launch keeps pairs in index order within a group: the torch alignment's
    output exactly, up to the padded total."""
    from minisrv.kernels.moe_align import align_reference, triton_align
    run = triton_align()
    assert run is not None, "Triton is missing"
    for t, top_k, num_experts, block_m in [(1, 2, 4, 16), (3, 2, 8, 16), (17, 4, 8, 64), (40, 4, 8, 16),
                                           (40, 2, 4, 64), (300, 4, 8, 16), (700, 8, 128, 64)]:
        _, ids = routing(t, num_experts, top_k, seed=t)
        for one_launch in (True, False):
            aligned = run(ids, num_experts, block_m, one_launch)
            total = check_alignment(aligned, ids, num_experts, block_m)
            if one_launch:
                assert_same_alignment(aligned, align_reference(ids, num_experts, block_m))
            print(f"moe align T={t} k={top_k} E={num_experts} BLOCK_M={block_m} "
                  f"{'one launch' if one_launch else 'three launches'}: {total} padded rows, invariants hold")


def assert_same_alignment(got: Aligned, ref: Aligned) -> None:
    """The same padded total, block table and pairs (in the same order) up to the total."""
    total = int(ref.num_padded.reshape(-1)[0])
    assert int(got.num_padded.reshape(-1)[0]) == total
    assert torch.equal(got.expert_ids.cpu(), ref.expert_ids.cpu())
    assert torch.equal(got.sorted_pairs[:total].cpu(), ref.sorted_pairs[:total].cpu()), "pairs out of order"


CASES = [((128, 64, 8, 2), "decode"), ((64, 128, 4, 2), "prefill"), ((96, 64, 8, 4), "decode"),
         ((128, 128, 8, 4), "prefill"), ((128, 64, 8, 4), "large")]  # (H, I, E, top_k), launch configuration
# (H 96: a partial K step and a partial column tile)
PAIRS = {"decode": (8, 16), "prefill": (512, 64), "large": (2048, 128)}  # pairs over 8 experts, block rows


def launch_config(name: str, fp8: bool):
    """config_for's configuration of each block size: decode (16 rows), prefill (64), large prefill (128)."""
    from minisrv.kernels.moe_gemm import config_for
    n_pairs, block_m = PAIRS[name]
    c = config_for(n_pairs, 8, fp8)
    assert c.block_m == block_m, c
    return c


def check_grouped_gemms() -> None:
    """Each launch of the grouped GEMM (kernels/moe_gemm.py) against float64 on the same operands: gate/up with
    SiLU-and-mul (A = the tokens' rows of x, or of x quantised per token), down with the routing weights (A = the
    first launch's output, or it quantised). The only differences are the float32 accumulation and the float16
    rounding of the output (2^-11 of each value): FP16_BOUND of the largest output."""
    from minisrv.kernels.fp8_quant import quantize_rows
    from minisrv.kernels.moe_align import triton_align
    from minisrv.kernels.moe_gemm import moe_gemm
    align, gemm = triton_align(), moe_gemm()
    for fp8 in (False, True):
        for (h, inter, num_experts, top_k), name in CASES:
            c = launch_config(name, fp8)
            for t in (1, 3, 17, 40):
                x, w13, w2, weights, ids, *scales = experts_inputs(t, h, inter, num_experts, top_k, torch.float16,
                                                                   fp8, seed=t + h)
                s13, s2 = scales or (None, None)
                aligned = align(ids, num_experts, c.block_m)
                e = ids.reshape(-1).long()
                tokens = torch.arange(t * top_k) // top_k
                a, a_scale = quantize_rows(x) if fp8 else (x, None)
                act = torch.empty(t * top_k, inter, dtype=torch.float16)
                gemm(a, a_scale, w13, s13, act, None, aligned, top_k, True, c)
                w13d = w13.double() * (s13.double()[..., None] if fp8 else 1)
                gu = torch.einsum("ph,pnh->pn", (a.double() * (a_scale.double() if fp8 else 1))[tokens], w13d[e])
                g, u = gu.chunk(2, dim=-1)
                errors = [_relative(act, g / (1 + torch.exp(-g)) * u)]

                a, a_scale = quantize_rows(act) if fp8 else (act, None)
                out = torch.empty(t * top_k, h, dtype=torch.float16)
                gemm(a, a_scale, w2, s2, out, weights.reshape(-1), aligned, 1, False, c)
                w2d = w2.double() * (s2.double()[..., None] if fp8 else 1)
                ref = torch.einsum("pi,phi->ph", a.double() * (a_scale.double() if fp8 else 1), w2d[e])
                errors.append(_relative(out, ref * weights.reshape(-1, 1).double()))
                what = f"{'FP8' if fp8 else 'fp16'} H={h} I={inter} E={num_experts} k={top_k} T={t} {name}"
                assert max(errors) <= FP16_BOUND, f"{what}: gate/up, down {errors}"
                print(f"moe grouped GEMMs {what} {tuple(c)}: max errors {errors[0]:.1e} (gate/up, SiLU), "
                      f"{errors[1]:.1e} (down, weighted) of the largest output")


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def check_fused_experts() -> None:
    """triton_experts (align, the two GEMMs, the quantisers between them, the sum over k) against
    experts_reference, T = 1, 3, 17, 40 over CASES. float16: FP16_BOUND of the largest output. FP8: the reference
    rounds gate/up to float16 before SiLU-and-mul and after each, the kernel rounds once, from float32; quantised
    to e4m3 (steps of 2^-4 to 2^-3), some of those values land on the other side of a rounding boundary, which
    moves an output by up to a few percent: FP8_NORM_BOUND of the output's norm."""
    from minisrv.kernels.fused_moe import experts_reference, triton_experts
    for fp8 in (False, True):
        for (h, inter, num_experts, top_k), name in CASES:
            c = launch_config(name, fp8)
            for t in (1, 3, 17, 40):
                args = experts_inputs(t, h, inter, num_experts, top_k, torch.float16, fp8, seed=t + h)
                got = triton_experts(*args, config=c)
                ref = experts_reference(*args).double()
                assert got.dtype == torch.float16 and got.shape == (t, h)
                what = f"{'FP8' if fp8 else 'fp16'} H={h} I={inter} E={num_experts} k={top_k} T={t} {name}"
                if fp8:
                    err, bound, of = ((got.double() - ref).norm() / ref.norm()).item(), FP8_NORM_BOUND, "norm"
                else:
                    err, bound, of = _relative(got, ref), FP16_BOUND, "largest output"
                assert err <= bound, f"{what}: {err:.2e} > {bound}"
                print(f"moe experts {what} {tuple(c)}: error {err:.1e} of the {of}")


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool):
    """The routing in float64: softmax over the experts, the k largest, divided by their sum if renormalize."""
    p = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(p, top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True) if renormalize else weights), ids


def check_route_kernel() -> None:
    """The one-launch router top-k (kernels/moe_route.py) against float64: token counts across its BLOCK_T rows
    (1 to 40), expert counts that are and are not powers of two, k from 1 to 8, with and without renormalisation;
    distinct logits (a random permutation in steps of 1/8, exact in float16), so the top-k has one answer. Then a
    row with NaN and -inf logits: every id stays in range."""
    from minisrv.kernels.moe_route import triton_route
    run = triton_route()
    g = torch.Generator().manual_seed(11)
    for t, num_experts, top_k in ((1, 8, 2), (5, 60, 6), (17, 128, 8), (40, 128, 8), (3, 4, 1)):
        logits = torch.stack([torch.randperm(num_experts, generator=g) / 8.0 - 4 for _ in range(t)])
        for renormalize in (True, False):
            weights, ids = run(logits.half(), top_k, renormalize)
            ref_w, ref_ids = route_reference(logits, top_k, renormalize)
            assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (t, top_k)
            assert torch.equal(ids.long(), ref_ids), (t, num_experts, top_k, renormalize)
            err = (weights.double() - ref_w).abs().max().item()
            assert err <= 1e-6, f"weights off by {err:.1e}"
            print(f"moe route T={t} E={num_experts} k={top_k} renormalize={renormalize}: weights within {err:.0e}")
    bad = torch.tensor([[float("nan"), 1.0, float("-inf"), 2.0], [float("-inf")] * 4])
    weights, ids = run(bad, 3, True)
    assert ids[0].tolist() == [3, 1, 0] or ids[0].tolist()[:2] == [3, 1], ids
    assert bool(((ids >= 0) & (ids < 4)).all()), ids
    print("moe route NaN and -inf rows: ids in range")


def check_router_kernel() -> None:
    """The router in one launch (kernels/moe_route.py's triton_router: product, top-k, alignment) against float64
    routing of the same logits and the torch alignment. x @ w^T is made exact in any summation order: w is a
    permuted identity over the first E columns of x (distinct logits in steps of 1/8, exact in float16) beside
    zero columns against random ones, so the product's K pieces and expert tiles all take part but add nothing
    inexact. 1 to 16 tokens, 8 / 60 / 128 experts, top-2 to top-8, with and without renormalisation; the arrival
    counter is left zero, and a second call on it gives the same. With a bias (gpt-oss's router): distinct multiples
    of 1/256 added to the logits (which stay distinct and exact), moving the weights."""
    from minisrv.kernels.moe_align import align_reference
    from minisrv.kernels.moe_route import triton_router
    run = triton_router()
    g = torch.Generator().manual_seed(5)
    counter = torch.zeros(1, dtype=torch.int32)
    for t, num_experts, top_k, renormalize, extra, block_m, biased in (
            (1, 8, 2, True, 40, 16, False), (3, 60, 6, False, 200, 16, False), (16, 128, 8, True, 300, 16, False),
            (7, 128, 8, True, 0, 64, False), (5, 32, 4, True, 100, 16, True)):
        logits = torch.stack([torch.randperm(num_experts, generator=g) / 8.0 - 4 for _ in range(t)])
        perm = torch.randperm(num_experts, generator=g)
        x = torch.cat([logits[:, perm], torch.randn(t, extra, generator=g)], dim=1).half()
        w = torch.zeros(num_experts, num_experts + extra)
        w[perm, torch.arange(num_experts)] = 1.0  # expert perm[i] reads column i, which holds its logit
        bias = torch.randperm(num_experts, generator=g) / 256.0 if biased else None  # distinct sums, exact
        for _ in range(2):
            weights, ids, aligned = run(x, w.half(), counter, top_k, renormalize, block_m,
                                        bias.half() if biased else None)
            ref_w, ref_ids = route_reference(logits + bias if biased else logits, top_k, renormalize)
            assert torch.equal(ids.long(), ref_ids), (t, num_experts, top_k)
            err = (weights.double() - ref_w).abs().max().item()
            assert err <= 1e-6, f"weights off by {err:.1e}"
            assert_same_alignment(aligned, align_reference(ids, num_experts, block_m))
            assert int(counter) == 0, "the arrival counter was not reset"
        print(f"moe router T={t} E={num_experts} k={top_k} H={num_experts + extra} bias={biased}: ids, weights "
              f"within {err:.0e}, alignment as the torch one's")


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' factories import Triton
    start = time.time()
    check_align_kernel()
    check_route_kernel()
    check_router_kernel()
    check_grouped_gemms()
    check_fused_experts()
    print(f"({time.time() - start:.0f} s)")
    print("ok")
