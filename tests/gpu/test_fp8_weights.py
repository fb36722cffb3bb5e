"""FP8 weights (`--quantization fp8`) on a CUDA GPU.

The layer: Fp8Linear on CUDA (per-token quantisation by the Triton kernel, then torch._scaled_mm's row-wise FP8
GEMM, bfloat16 out) against the CPU path's arithmetic in float64 on the same bytes: the only differences are the
GEMM's summation order and the bf16 rounding of the output (2^-9 of each value), so 1e-2 relative. The Triton
quantiser against quantize_rows (torch): the same scales, and values at most one e4m3 step apart (its division
may round the last float32 bit differently, which can move a value across a rounding boundary).

End to end: the random-weight Qwen3-0.6B-shaped checkpoint with FP8 weights (and with an FP8 KV cache too) against
two HF references, with CUDA graphs and overlap scheduling on: every generated token must be the reference's argmax
or within a gap of it.
- HF on the same weights: HF transformers in bf16 with each projection's weight replaced by its e4m3 per-row
  rounding (what minisrv multiplies by). What is left is minisrv's own rounding: the activations to e4m3 per token,
  and the KV cache's. Held to SAME_WEIGHTS_GAP = 0.25, the issue's bound (0.22 measured on an H100).
- HF on the original bf16 weights: adds the weight rounding the user asked for. Rounding weights and activations to
  e4m3 (3 mantissa bits) moves each projection's output by a few percent; over 28 layers a near-tie can flip by a
  third of a logit (0.36-0.41 measured, weights and KV in FP8), so this one is held to BF16_GAP = 0.5.
"""
from __future__ import annotations

import pytest
import torch

from minisrv import LLM, SamplingParams
from minisrv.kernels.fp8_gemm import config_for, small_m_fp8_gemm
from minisrv.kernels.fp8_quant import triton_quantisers
from minisrv.models.fp8 import FP8, Fp8Linear, quantize_rows

from .common import (CKPT, assert_near_hf_greedy, decode_kernel, free_cuda, hf_model, mixed_prompts, requires_ckpt,
                     skip_unless_runs)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SAME_WEIGHTS_GAP = 0.25  # against HF on the dequantised FP8 weights
BF16_GAP = 0.5  # against HF on the original bf16 weights (see the module docstring)
N_PROMPTS, N_NEW = 16, 32


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("k,n", [(1024, 3072), (3072, 1024)])
def test_layer_matches_float64(m, k, n):
    g = torch.Generator(device="cuda").manual_seed(m)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g) * 0.05)
    layer = Fp8Linear.from_linear(lin)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    xq, xs = quantize_rows(x)  # the torch quantiser: the CPU path's arithmetic
    ref = (xq.double() * xs.double()) @ layer.dequantized_weight().double().t()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"m={m} k={k} n={n}: relative error {err:.2e}"


@pytest.mark.parametrize("shape", [(1, 1024), (37, 4096), (256, 14336)])
def test_triton_quantiser_matches_torch(shape):
    fused = triton_quantisers()
    assert fused is not None, "Triton is missing: activations are quantised by five torch kernels"
    x = (torch.randn(*shape, device="cuda") * torch.logspace(-3, 2, shape[0], device="cuda")[:, None]).bfloat16()
    x[0, :7] = 0  # zeros stay zero
    q1, s1 = fused.quant(x)
    q2, s2 = quantize_rows(x)
    assert torch.allclose(s1, s2, rtol=1e-6, atol=0)
    a, b = q1.float(), q2.float()
    step = torch.maximum(a.abs(), b.abs()) * 2.0 ** -3 + 2.0 ** -9
    assert ((a - b).abs() <= step).all()
    assert (a != b).float().mean().item() < 1e-3


def _within_e4m3(q: torch.Tensor, scale: torch.Tensor, ref: torch.Tensor) -> bool:
    """q * scale is ref rounded to e4m3: within half a step (2^-4 of the value, half of 2^-9 of the scale near
    zero), plus one bf16 rounding of ref (2^-8) that a different summation order may flip."""
    deq, ref = q.float() * scale, ref.float()
    return bool(((deq - ref).abs() <= (2 ** -4 + 2 ** -8) * ref.abs() + 2 ** -10 * scale).all())


@pytest.mark.parametrize("t,h", [(1, 4096), (37, 1024), (300, 4096)])
def test_fused_quantisers_match_the_unfused_path(t, h):
    """The decoder's add + RMSNorm and the MLP's SiLU-and-mul, each computed and quantised in one kernel, against
    the same computed by torch in HF's order and quantised separately."""
    fused = triton_quantisers()
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    res = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w = (torch.rand(h, device="cuda", generator=g) + 0.5).bfloat16()
    total = x + res
    normed = lambda v: (  # noqa: E731
        w * (v.float() * torch.rsqrt(v.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16())
    residual = res.clone()
    q, s = fused.add_norm_quant(x, residual, w, 1e-6)
    assert torch.equal(residual, total), "the residual becomes x + residual, in place"
    assert q.dtype == FP8 and s.shape == (t, 1) and _within_e4m3(q, s, normed(total))
    q, s = fused.add_norm_quant(x, None, w, 1e-6)
    assert _within_e4m3(q, s, normed(x))
    gu = torch.randn(t, 2 * 3 * h, device="cuda", generator=g).bfloat16()  # 3 h wide: 12,288 at h = 4096
    gate, up = gu.chunk(2, dim=-1)
    q, s = fused.silu_mul_quant(gu)
    assert q.shape == (t, 3 * h) and _within_e4m3(q, s, torch.nn.functional.silu(gate.float()) * up.float())


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(N_PROMPTS, 8, 300, seed=11)


@pytest.fixture(scope="module")
def hf_same_weights():
    """HF in bf16 with every projection's weight replaced by its e4m3 per-row rounding, as minisrv quantises it
    (q, k, v rows and gate, up rows are scaled one by one, so the fused layers' rows are the same)."""
    m = hf_model()
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, mod in m.named_modules():
            if name.rsplit(".", 1)[-1] in names:
                q, s = quantize_rows(mod.weight)
                mod.weight.copy_((q.float() * s).to(mod.weight.dtype))
    yield m
    del m
    free_cuda()


@requires_ckpt
@pytest.mark.parametrize("backend,kv,kernel", [("fa,fi", "fp8_e4m3", "auto"), ("fi", "fp8_e4m3", "auto"),
                                               ("fi", "fp8_e4m3", "flashinfer"), ("fi", "auto", "auto")])
def test_greedy_matches_hf_with_fp8_weights_and_kv(backend, kv, kernel, prompts, hf, hf_same_weights):
    skip_unless_runs(backend)
    llm = LLM(model=CKPT, attention_backend=backend, dtype="bfloat16", quantization="fp8", kv_cache_dtype=kv,
              fp8_decode_kernel=kernel, max_total_tokens=65536, cuda_graph_max_bs=64, log_level="warning")
    eng = llm.engine
    used = decode_kernel(eng.runner.backend)
    try:
        n_fp8 = sum(isinstance(m, Fp8Linear) for m in eng.runner.model.modules())
        assert n_fp8 == 4 * eng.parts.args.num_layers and eng.parts.pool.quantized == (kv == "fp8_e4m3") and eng.overlap
        assert eng.runner.graph_runner is not None
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                            use_tqdm=False)
        assert eng.flush_cache() and eng.parts.allocator.num_free == eng.num_free_pages_when_idle
    finally:
        del llm, eng
        free_cuda()
    what = f"{backend} with FP8 weights, KV {kv}, decode kernel {used}"
    assert_near_hf_greedy(hf_same_weights, prompts, outs, N_NEW, SAME_WEIGHTS_GAP,
                          f"{what}, against HF on the same FP8 weights")
    assert_near_hf_greedy(hf, prompts, outs, N_NEW, BF16_GAP, f"{what}, against HF on the bf16 weights")


def _small_m_product(w: torch.Tensor, x: torch.Tensor):
    """(product, ref): the small-batch FP8 kernel's x W^T on x and W quantised per row, as a function of its launch
    parameters (`product(config=None, raise_errors=False)`, run's), and torch._scaled_mm's on the same operands."""
    run = small_m_fp8_gemm()
    wq, ws = quantize_rows(w)
    ws = ws.reshape(1, -1).contiguous()
    xq, xs = quantize_rows(x)
    return (lambda **kw: run(xq, xs, wq, ws, **kw),
            torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16))


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("m", [1, 16, 33, 64])
def test_small_batch_kernel_runs_and_matches_scaled_mm(m):
    """Decode batches take the narrow-tile Triton kernel (it must compile and run here, not fall back), and it
    computes what torch._scaled_mm's row-wise FP8 GEMM computes on the same operands."""
    g = torch.Generator(device="cuda").manual_seed(m)
    n, k = 4096, 14336
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    product, ref = _small_m_product(w, x)
    got = product()
    assert got is not None, f"the small-batch FP8 kernel fell back to torch._scaled_mm ({config_for(n, k, m)})"
    err = _relative_error(got, ref)
    assert err < 1e-2, f"m={m}: {err:.2e} from the reference"


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 4096),
                                 (4096, 2048), (14336, 4096), (4096, 7168)])
def test_every_launch_rule_on_llama_shapes_matches_scaled_mm(n, k):
    """Each configuration the launch rules give Llama-3-8B's projections (tp 1 and a tp 2 rank's) compiles and
    computes torch._scaled_mm's product, at the smallest and largest batch of each rule's range of rows."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    for m in (1, 16, 17, 32, 33, 64):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        product, ref = _small_m_product(w, x)
        config = config_for(n, k, m)
        err = _relative_error(product(config=config, raise_errors=True), ref)
        assert err < 1e-2, f"{n}x{k} {tuple(config)} at m={m}: {err:.2e} from torch._scaled_mm"
