"""A GEMM for few rows (decode batches): y = x W^T in bf16, for x [m <= SMALL_M, K] and W [N, K], on CUDA (Triton).

Why: at decode a projection reads its whole weight matrix for a handful of tokens, so the product is a matter of
reading W at the memory bandwidth. cuBLAS tiles the output 64-128 columns at a time, so a 4096-wide projection (or a
tensor-parallel rank's half of one) runs on a few dozen of the GPU's 132 SMs and reads its weights at half the
bandwidth. Here each program owns 16-128 output columns and all of the rows, so every SM streams a share of W;
where that still leaves too few programs, a configuration may split K over 2-4 programs per column block
(`split_k`: each writes float32 partial sums, the last to finish adds them up and stores the output).

Two operand kinds, float32 accumulation:
- "fp8":  x and W in float8_e4m3fn, x scaled per row (xs [m, 1]), W per output column (ws [1, N]): the same
          operands and product as `torch._scaled_mm`'s row-wise mode (W8A8). FP8 weights take it up to SMALL_M rows.
- "bf16": x and W in bf16: what `F.linear` computes. bf16 weights take it with --decode-gemm triton up to
          SMALL_M_BF16 rows (beyond, cuBLAS was as fast or faster in the sweep), and with --decode-gemm auto (the
          default) for one row where this GPU's table has a one-row configuration for the shape.
Two kernels (small_m_kernels.py): a tensor-core dot over the rows padded to 16, and for one row (a configuration with
`gemv`) multiply-adds in registers with one sum per column at the end, which reads W faster at batch-1 decode.
Launch parameters come from `config_for`: a sweep's table for this GPU where one is shipped (small_m_configs/, written
by `scripts/bench_small_m_gemm.py --write-configs`, as vLLM and SGLang ship tuned Triton configurations per device),
else the rules of `default_config` (drawn from the same sweeps on an H100). K must be a multiple of the chosen K step:
every default takes any K that `fits`, and a table's entries are checked against their K as it is read.

Measured and not kept: FP8 weights with bf16 activations (W8A16: W widened to bf16, or to float16 with x rounded
to float16, in registers; no activation quantiser) ran 1.3-2.5x slower than W8A8 here at every Llama-3-8B shape
(down 4096 x 14336: 32 us at m = 1, 60 us at m = 64, against 25 and 25), for a worst greedy gap to HF on the same
FP8 weights of 0.20 against W8A8's 0.22 (tests/gpu/test_fp8_weights.py).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

SMALL_M = 64  # token counts up to this (decode batches) take the FP8 kernel
SMALL_M_BF16 = 16  # and up to this the bf16 one
MIN_BLOCK_K = 128  # every configuration's K step is a multiple of this: K must be too
KINDS = ("fp8", "bf16")
MAX_COLUMN_BLOCKS = 1 << 16  # output column blocks of one split-K product (its arrival counters)


class SmallMConfig(NamedTuple):
    """Launch parameters (scripts/bench_small_m_gemm.py sweeps them)."""

    block_n: int  # output columns a program owns
    block_k: int  # the reduction's step; the input width must be a multiple of block_k x split_k
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs that share a column block, each over its slice of K (see small_m_gemm)
    gemv: bool = False  # one row (m = 1): multiply-adds in registers and a row sum instead of a padded dot


def kind_of(x: torch.Tensor, w: torch.Tensor) -> str:
    """The operand kind ("fp8", "bf16") of x and W, or ValueError for a pair the kernel does not take."""
    if x.dtype == torch.float8_e4m3fn and w.dtype == torch.float8_e4m3fn:
        return "fp8"
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        return "bf16"
    raise ValueError(f"no small-batch GEMM for x {x.dtype} and W {w.dtype}")


def default_config(kind: str, n: int, k: int, m: int) -> SmallMConfig:
    """Launch parameters for an [m, k] x [n, k]^T product of the given kind, from the H100 sweeps of Llama-3-8B's
    projections (and, for bf16, a tensor-parallel rank's halves of them) at m = 1, 16, 64.

    FP8: narrow outputs want 16-column programs, K steps of 256 and two warps for a few rows (four for more), and
    deeper pipelines for long reductions; the 4096 x 14336 down projection went from 35 to 25 us, the 4096 x 4096 o
    projection from 9.8 to 7.3 us at m = 1. Wide outputs (> 8192 columns) already have enough programs and keep 32
    columns and K steps of 128.
    bf16 (m <= 16): 32 columns and K steps of 256 (128 for wide outputs), deeper pipelines for long reductions; at
    m = 1 the 4096 x 7168 down projection of tp 2 went from cuBLAS's 25.0 to 22.7 us, the 4096 x 4096 o projection
    from 11.3 to 9.2 us; gate_up stayed level (80 against 83 us)."""
    if kind == "bf16":
        if n > 8192 or k % 256:
            return SmallMConfig(32, 128, 4 if m == 1 else 2, 3)
        return SmallMConfig(32, 256, 4 if m == 1 else 2, 5 if k > 4096 else 4)
    if n > 8192 or k % 256:
        return SmallMConfig(32 if n > 8192 else 16, 128, 4, 3 if n > 8192 else 4)
    stages = 5 if k > 8192 else (3 if m <= 16 else 4)
    return SmallMConfig(16, 256, 2, stages) if m <= 16 else SmallMConfig(32, 256, 4, stages)


CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_m_configs")
TUNED_M = (1, 16, 32, 64)  # the batch sizes a table holds; a batch takes the entry of the next one up


def config_file(device_name: str, directory: str = CONFIG_DIR) -> str:
    """The table of one GPU model, e.g. small_m_configs/NVIDIA_H100_80GB_HBM3.json."""
    return os.path.join(directory, re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


@functools.lru_cache(maxsize=None)
def tuned_configs(device_name: str, directory: str = CONFIG_DIR) -> Dict[str, SmallMConfig]:
    """A GPU model's sweep results, {"kind NxK m": config}, or {} where none is shipped. A table with an entry
    whose K step is not a multiple of MIN_BLOCK_K, or whose K steps times K slices do not divide its K, or a one-row
    entry for batches of more rows, is refused (ValueError): every entry it returns fits the products of its key."""
    try:
        with open(config_file(device_name, directory)) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return {}
    table = {key: SmallMConfig(*value) for key, value in raw.items()}
    bad = [key for key, c in table.items()
           if c.block_k % MIN_BLOCK_K or int(key.split()[1].split("x")[1]) % (c.block_k * c.split_k)]
    if bad:
        raise ValueError(f"{config_file(device_name, directory)}: K steps that do not divide K: {bad}")
    bad = [key for key, c in table.items() if c.gemv and key.split()[2] != "1"]
    if bad:
        raise ValueError(f"{config_file(device_name, directory)}: one-row (gemv) entries for more rows: {bad}")
    return table


def tuned_key(kind: str, n: int, k: int, m: int) -> str:
    """The table key of a product: its kind, its weight's shape and the tuned batch size that covers m."""
    return f"{kind} {n}x{k} {next((t for t in TUNED_M if m <= t), TUNED_M[-1])}"


def config_for(kind: str, n: int, k: int, m: int, device_name: Optional[str] = None) -> SmallMConfig:
    """The launch parameters for this product on this GPU model: its sweep's best where the shipped table has the
    shape, else `default_config`'s."""
    tuned = tuned_configs(device_name).get(tuned_key(kind, n, k, m)) if device_name else None
    return tuned if tuned is not None else default_config(kind, n, k, m)


def fits(k: int) -> bool:
    """Whether an input width K can take the kernel (every default K step divides it)."""
    return k % MIN_BLOCK_K == 0


def takes_silu_mul(config: SmallMConfig, kind: str, m: int, n: int) -> bool:
    """Whether a product with this configuration can end in SiLU-and-mul (run(..., silu_mul=True)): the one-row
    kernel on bf16 operands, K not split (the activation needs each column's whole sum in one program), and W a
    gate and an up projection stacked (an even number of rows, at least two a program)."""
    return (config.gemv and config.split_k == 1 and config.block_n >= 2 and kind == "bf16" and m == 1
            and n % 2 == 0)


def supports_dependent_launch(device: torch.device) -> bool:
    """Whether kernels on this device can be programmatic dependent launches (CUDA, SM 90 and later).
    MINISRV_NO_PDL=1 says no (for a benchmark's comparison)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and os.environ.get("MINISRV_NO_PDL") != "1")


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=None)
def small_m_gemm() -> Optional[Callable[..., Optional[torch.Tensor]]]:
    """The kernel's launcher `run(x, w, xs=None, ws=None, config=None, raise_errors=False, silu_mul=False,
    gdc=False, dependent_launch=False)`, or None where Triton is missing. `run` returns None (and keeps returning
    None for that operand kind, so callers use cuBLAS) if the kernel cannot compile here, unless raise_errors (a
    sweep's configurations that do not fit are its own business). With silu_mul, W is a gate and up projection
    stacked and `run` returns silu(gate) * up ([1, N / 2]; only where `takes_silu_mul`). With gdc (SM 90+) the
    one-row kernel's programs let a next kernel launched as a programmatic dependent launch start at once (and wait
    for the kernel before them before they read anything); with dependent_launch too, the kernel is launched so.
    The layers use the pair where one one-row product follows another (the gated MLP's gate_up, then its down):
    an H200 decode step of one tp 2 rank's share of Llama-3-8B (batch 1) 3.109 -> 3.078 ms. Every product so took
    that step to 3.044 ms but the whole model's (tp 1) from 4.760 to 4.816 ms, so the others stay plain launches."""
    try:
        import triton

        from .small_m_kernels import gemv_kernel, kernel
    except Exception:  # noqa: BLE001 - any import failure means "not present"
        return None

    # device -> int32 zeros, one per column block, made once and kept (graphs that captured a split-K product
    # hold its address); every split-K product leaves them 0. Products on one device must not overlap in time:
    # minisrv runs its forward passes on one stream.
    arrival_counters: dict = {}

    def counters(device: torch.device) -> torch.Tensor:
        if device not in arrival_counters:
            arrival_counters[device] = torch.zeros(MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)
        return arrival_counters[device]

    broken: dict = {}  # kind -> the error that turned the kernel off for good for that kind

    def run(x: torch.Tensor, w: torch.Tensor, xs: Optional[torch.Tensor] = None, ws: Optional[torch.Tensor] = None,
            config: Optional[SmallMConfig] = None, raise_errors: bool = False, silu_mul: bool = False,
            gdc: bool = False, dependent_launch: bool = False) -> Optional[torch.Tensor]:
        kind = kind_of(x, w)
        if kind in broken and not raise_errors:
            return None
        m, k = x.shape
        n = w.shape[0]
        c = config or config_for(kind, n, k, m, device_name(x.device))
        if k % (c.block_k * c.split_k) or (kind == "fp8") != (xs is not None) or (kind == "fp8") != (ws is not None):
            raise ValueError(f"{kind} GEMM of K={k}: K step {c.block_k} x {c.split_k} slices, x scale "
                             f"{xs is not None}, W scale {ws is not None}")
        if dependent_launch and not gdc:
            raise ValueError("a dependent launch needs the kernel's grid dependency control (gdc)")
        if silu_mul and not takes_silu_mul(c, kind, m, n):
            raise ValueError(f"no SiLU-and-mul product for {kind} {n}x{k} at m={m} with {tuple(c)}")
        # with silu_mul a program's block_n weight rows are its half as many output columns' gate and up rows
        cols, block_n = (n // 2, c.block_n // 2) if silu_mul else (n, c.block_n)
        y = torch.empty((m, cols), dtype=torch.bfloat16, device=x.device)
        blocks = triton.cdiv(cols, block_n)
        part, arrivals = y, y  # not read with one slice of K
        if c.split_k > 1:
            if blocks > MAX_COLUMN_BLOCKS:
                raise ValueError(f"split-K GEMM of {blocks} column blocks: at most {MAX_COLUMN_BLOCKS}")
            part = torch.empty((c.split_k, m, n), dtype=torch.float32, device=x.device)
            arrivals = counters(x.device)
        operands = (x, xs if xs is not None else x, w, ws if ws is not None else w, y, part, arrivals)
        try:
            if c.gemv and m == 1:
                gemv_kernel[(blocks, c.split_k)](
                    *operands, cols, k, BLOCK_N=block_n, BLOCK_K=c.block_k, SCALED=kind == "fp8",
                    SPLIT_K=c.split_k, SILU_MUL=silu_mul, GDC=gdc, num_warps=c.num_warps,
                    num_stages=c.num_stages, **({"launch_pdl": True} if dependent_launch else {}))
            else:
                kernel[(blocks, c.split_k)](
                    *operands, m, n, k, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=c.block_n,
                    BLOCK_K=c.block_k, SCALED=kind == "fp8", SPLIT_K=c.split_k,
                    num_warps=c.num_warps, num_stages=c.num_stages)
        except Exception as e:  # noqa: BLE001 - e.g. a Triton without FP8 dot support on this GPU
            if raise_errors:
                raise
            logging.getLogger("minisrv").warning("small-batch %s GEMM unavailable (%s: %s); using cuBLAS",
                                                 kind, type(e).__name__, e)
            broken[kind] = e
            return None
        return y

    return run


class SmallBatchLinear(nn.Linear):
    """nn.Linear whose decode batches (bf16 on CUDA, K a multiple of MIN_BLOCK_K) take the small-batch kernel;
    everything else (prefill, the CPU, other dtypes) F.linear. Which batches: up to SMALL_M_BF16 rows
    (--decode-gemm triton), or, with `tuned_one_row_only` (--decode-gemm auto), a single row where this GPU's
    table gives the one-row kernel for the shape (a sweep found it faster than cuBLAS there). The parameters are
    nn.Linear's: `use_for_projections` turns a built model's projections into these in place."""

    tuned_one_row_only = False
    gdc = False  # one-row products with grid dependency control (SM 90+; see small_m_gemm)

    def kernel_config(self, x2: torch.Tensor) -> Optional[SmallMConfig]:
        """The launch parameters the small-batch kernel runs an input with (x2: its 2-D view, one row a token), or
        None where F.linear takes it. With `tuned_one_row_only`: a single row whose configuration in this GPU's
        table is the one-row kernel's (SmallMConfig.gemv)."""
        rows = x2.shape[0]
        if not (x2.is_cuda and x2.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16
                and 0 < rows <= SMALL_M_BF16 and fits(self.in_features)):
            return None
        if self.tuned_one_row_only and rows != 1:
            return None
        config = config_for("bf16", self.out_features, self.in_features, rows, device_name(x2.device))
        return None if self.tuned_one_row_only and not config.gemv else config

    def silu_mul_forward(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """For a gated MLP's stacked gate and up projection: silu(gate) * up of x in one kernel with the product,
        or None where the kernel does not take x (the caller then runs `forward` and the activation apart). Taken
        for a single bf16 row whose shape has this GPU's one-row configuration without split K. With `gdc` its
        programs let the down projection after it (forward(after_one_row=True)) be launched at once."""
        x2 = x.reshape(-1, x.shape[-1])
        config = self.kernel_config(x2) if self.bias is None and x2.shape[0] == 1 else None
        run = small_m_gemm()
        if config is None or run is None or not takes_silu_mul(config, "bf16", 1, self.out_features):
            return None
        out = run(x2.contiguous(), self.weight, config=config, silu_mul=True, gdc=self.gdc)
        return None if out is None else out.reshape(*x.shape[:-1], self.out_features // 2)

    def forward(self, x: torch.Tensor, after_one_row: bool = False) -> torch.Tensor:
        """after_one_row: x is the output of a one-row product whose kernel lets the next one start early (the gated
        MLP's gate and up, `silu_mul_forward`): the one-row kernel is then a programmatic dependent launch where
        grid dependency control is on (`gdc`). Other products leave it off: after the norm and attention kernels it
        did not pay."""
        x2 = x.reshape(-1, x.shape[-1])
        config = self.kernel_config(x2)
        run = small_m_gemm() if config is not None else None
        if run is not None:
            pdl = self.gdc and after_one_row
            out = run(x2.contiguous(), self.weight, config=config, gdc=pdl, dependent_launch=pdl)
            if out is not None:
                if self.bias is not None:
                    out = out + self.bias
                return out.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def use_for_projections(model: nn.Module, names: Tuple[str, ...], tuned_one_row_only: bool = False,
                        gdc: bool = False) -> int:
    """Make the model's nn.Linear children called `names` SmallBatchLinear (same parameters, new forward), taking
    the kernel for every decode batch, or with `tuned_one_row_only` for the single rows this GPU's table tunes;
    `gdc`: their one-row products use grid dependency control (`supports_dependent_launch`; see small_m_gemm).
    Returns how many changed."""
    count = 0
    for module in model.modules():
        for name in names:
            child = getattr(module, name, None)
            if type(child) is nn.Linear:
                child.__class__ = SmallBatchLinear
                child.tuned_one_row_only = tuned_one_row_only
                child.gdc = gdc
                count += 1
    return count
