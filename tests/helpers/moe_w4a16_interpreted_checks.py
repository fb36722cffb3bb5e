"""The 4-bit experts' grouped GEMM (minisrv/kernels/moe_gemm.py's INT4 path, driven by fused_moe.triton_experts) run by
Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before Triton is imported: hence a script of its own, run by
tests/test_w4a16_moe.py in a fresh process). Also imported by tests/gpu/test_w4a16_moe.py for its operands and
reference (importing it does not switch the interpreter on; running it does).

Checked against a float64 computation of the experts from the 4-bit values themselves (out = sum_j w_j *
down_e(silu(gate_e(x)) * up_e(x)), W = (q - zero) * scale, activation order applied as the format defines it):
the three launch configurations of the rule (decode, prefill, large prefill blocks), groups of 16, 32 and 64 rows and
one per channel, symmetric and asymmetric zero points, activation order (a per-expert perm on both products),
output widths that are not a multiple of the tile, float16 activations (the interpreter's bfloat16 products are not
the GPU's). The kernel rounds the dequantised weight and the SiLU-and-mul output to float16 (2^-11 relative each):
BOUND of the largest output. Prints one line per check and "ok" at the end; raises AssertionError on a failure."""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minisrv.kernels.moe_w4a16 import PackedExperts  # noqa: E402
from minisrv.kernels.w4a16_gemm import pack_rows  # noqa: E402

BOUND = 3e-3  # of the largest output


class RandomExperts:
    """E random 4-bit [k, n] matrices: their values, scales and zeros (and perm) as drawn (on the CPU, then moved to
    `device`), and packed."""

    def __init__(self, num_experts: int, k: int, n: int, group: int, symmetric: bool, act_order: bool,
                 gen: torch.Generator, scale_dtype: torch.dtype = torch.float16, device: str = "cpu") -> None:
        groups = k // (group or k)
        self.values = torch.randint(0, 16, (num_experts, k, n), generator=gen, dtype=torch.uint8)
        # each column's scale spread over [1/4, 4] of its neighbours': a scale read for the wrong column is off O(1)
        spread = 4 ** (2 * torch.rand(num_experts, 1, n, generator=gen) - 1)
        self.scales = ((torch.rand(num_experts, groups, n, generator=gen) + 0.5) * spread * 0.3 * k ** -0.5
                       ).to(scale_dtype)
        self.zeros = torch.full((num_experts, groups, n), 8, dtype=torch.uint8) if symmetric else \
            torch.randint(0, 16, (num_experts, groups, n), generator=gen, dtype=torch.uint8)
        self.perm = torch.stack([torch.randperm(k, generator=gen) for _ in range(num_experts)]) if act_order \
            else None
        self.values, self.scales, self.zeros = self.values.to(device), self.scales.to(device), self.zeros.to(device)
        self.perm = self.perm.to(device) if act_order else None

    def packed(self) -> PackedExperts:
        qweight = torch.stack([pack_rows(v) for v in self.values])
        return PackedExperts(qweight, self.scales, self.zeros, self.perm)

    def float64(self, e: int) -> torch.Tensor:
        """Expert e's W [k, n] in float64, rows in the layer's order."""
        group = self.values.shape[1] // self.scales.shape[1]
        z = self.zeros[e].double().repeat_interleave(group, 0)
        return (self.values[e].double() - z) * self.scales[e].double().repeat_interleave(group, 0)

    def product(self, a: torch.Tensor, e: int) -> torch.Tensor:
        """a [rows, k] float64 @ W_e, the input's columns gathered in the expert's activation order."""
        return (a if self.perm is None else a[:, self.perm[e]]) @ self.float64(e)


def experts_float64(x: torch.Tensor, w13: RandomExperts, w2: RandomExperts, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    t, top_k = ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float64)
    for token in range(t):
        for j in range(top_k):
            e = int(ids[token, j])
            g, u = w13.product(x[token:token + 1].double(), e).chunk(2, dim=-1)
            out[token] += float(weights[token, j]) * w2.product(g / (1 + torch.exp(-g)) * u, e)[0]
    return out


def experts_case(t: int, h: int, inter: int, num_experts: int, top_k: int, group: int, symmetric: bool,
                 act_order: bool, seed: int, scale_dtype: torch.dtype = torch.float16
                 ) -> Tuple[torch.Tensor, RandomExperts, RandomExperts, torch.Tensor, torch.Tensor]:
    """x [t, h] (float32), the two random 4-bit stacks, and a random top-k routing (renormalised weights)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = RandomExperts(num_experts, h, 2 * inter, group, symmetric, act_order, gen, scale_dtype)
    w2 = RandomExperts(num_experts, inter, h, group, symmetric, act_order, gen, scale_dtype)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(t)]).int()
    weights = torch.rand(t, top_k, generator=gen) + 0.1
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


def check(t: int, h: int, inter: int, num_experts: int, top_k: int, group: int, symmetric: bool, act_order: bool,
          n_pairs_rule: Optional[int] = None, by_pair: bool = False) -> None:
    """triton_experts on the case, with the launch rule's configuration for n_pairs_rule pairs (default: t * k);
    by_pair: no configuration given, so that up to PAIR_ROWS pairs run as rows of the dense 4-bit kernel."""
    from minisrv.kernels.fused_moe import experts_reference, launch_config, triton_experts
    x, w13, w2, weights, ids = experts_case(t, h, inter, num_experts, top_k, group, symmetric, act_order,
                                            seed=t * 31 + h + inter + group)
    p13, p2 = w13.packed(), w2.packed()
    c = launch_config(n_pairs_rule or t * top_k, p13, False)  # (K steps halved in the launch to fit a group)
    got = triton_experts(x.half(), p13, p2, weights, ids, config=None if by_pair else c)
    ref = experts_float64(x, w13, w2, weights, ids)
    err = relative_error(got, ref)
    what = (f"H={h} I={inter} E={num_experts} k={top_k} T={t} group={group or 'channel'} "
            f"{'sym' if symmetric else 'asym'}{' act-order' if act_order else ''} "
            f"{'by pair' if by_pair else tuple(c)}")
    assert got.dtype == torch.float16 and got.shape == (t, h), (got.dtype, got.shape)
    assert err <= BOUND, f"{what}: error {err:.2e}"
    # the torch path (the CPU's) on the same operands, in float64: the same numbers
    cpu = experts_reference(x.double(), p13, p2, weights, ids)
    assert relative_error(cpu, ref) <= 1e-12, what
    print(f"4-bit experts {what}: error {err:.1e} of the largest output")


def main() -> None:
    from minisrv.kernels.moe_gemm import moe_gemm
    assert moe_gemm() is not None, "Triton is missing"
    start = time.time()
    for group, symmetric, act_order in ((32, False, False), (64, True, False), (16, False, True), (0, False, False)):
        for t in (1, 5):
            check(t, 128, 64, 8, 2, group, symmetric, act_order)  # decode blocks (16 rows, 64 columns)
    for group in (32, 0):
        check(40, 128, 64, 4, 2, group, False, False, n_pairs_rule=256)  # prefill blocks (64 rows, 128 columns)
    check(17, 64, 96, 4, 4, 32, False, True, n_pairs_rule=2048)  # large blocks (128 rows); partial tiles
    check(3, 96, 48, 4, 4, 16, True, False)  # N 96 and 48: partial column tiles
    for t, top_k, group in ((1, 2, 32), (4, 4, 0), (2, 8, 64)):  # decode pairs as rows of the dense kernel
        check(t, 128, 96, 8, top_k, group, False, False, by_pair=True)
    print(f"({time.time() - start:.0f} s)")
    print("ok")


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' factories import Triton
    main()
