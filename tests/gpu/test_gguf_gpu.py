"""GGUF blocks kept as planes on a CUDA GPU (models/gguf_planes.py, planes_layers.py, kernels/w4a16_gemm.py).

The W4A16 GEMM over each block type's planes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; random blocks, every
byte drawn, scales about 0.01) against the dequantise-then-matmul product in float64, bfloat16 and float16
activations, batches 1 to 512 (the CUDA cores' split-K path, tensor-core tiles, the weight dequantised whole), eager
and replayed from a CUDA graph (the replay must be the eager run bit for bit). The layer (a fused projection joining
Q4_K and Q6_K rows, a bias) against its CPU path; a small Q4_K_M-like model on CUDA against the same file loaded
dequantised to bfloat16: greedy tokens equal up to near-ties, its planes within 1.1x the file's matrices.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from minisrv.kernels.w4a16_gemm import config_for, dequantize_planes, w4a16_gemm
from minisrv.models.gguf_blocks import GGUFBlocks
from minisrv.models.gguf_planes import PLANE_FORMATS, to_planes
from minisrv.models.planes_layers import PlanesLinear

from ..helpers.kquant_blocks import random_blocks
from .common import assert_same_up_to_ties, free_cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # as tests/gpu/test_w4a16.py's
KINDS = [Q(k).name for k in PLANE_FORMATS]


def planes_of(kind: str, n: int, k: int, seed: int):
    raw = random_blocks(kind, n, k, seed=seed, small=True)
    return raw, to_planes(raw, Q[kind], n, k, None, torch.device("cuda"))


def _error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k,n", [(4096, 1536), (2048, 4104)])
def test_kernel_against_dequantised_matmul(k, n, kind, dtype):
    run = w4a16_gemm()
    assert run is not None, "Triton is missing"
    _, planes = planes_of(kind, n, k, seed=k + n)
    w = dequantize_planes(planes, torch.float64)
    for m in (1, 2, 3, 7, 16, 17, 33, 64, 65, 128, 257, 512):
        x = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m)).to(dtype)
        y = run(x, planes)
        assert y.shape == (m, n) and y.dtype == dtype
        err = _error(y, x.double() @ w)
        assert err <= BOUND[dtype], f"{kind} m={m} k={k} n={n} {dtype} {tuple(config_for(m, n, k, 256))}: {err:.2e}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 2, 8, 64, 200, 512])
def test_kernel_in_a_cuda_graph(m, kind):
    """Captured once, replayed on new activations written into the captured input: the eager output, bit for bit."""
    run = w4a16_gemm()
    k, n = 4096, 2048
    _, planes = planes_of(kind, n, k, seed=m)
    x = torch.randn(m, k, device="cuda").bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(x, planes)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = run(x, planes)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        x.copy_(torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        eager = run(x, planes)
        assert torch.equal(out, eager), f"{kind} m={m}: the replay differs from the eager run"
        assert _error(out, x.double() @ dequantize_planes(planes, torch.float64)) <= BOUND[torch.bfloat16]


@pytest.mark.parametrize("m", [1, 2, 40, 300])
def test_layer_joining_types_against_its_cpu_path(m):
    """A fused projection of Q4_K rows then Q6_K rows, with a bias: the GEMM a type into its columns on CUDA
    against the CPU's dequantised product of the same planes."""
    k = 4096
    layer = PlanesLinear(k, 3072, True)
    layer.device_probe = torch.empty(0, device="cuda")
    for row, (kind, n) in zip((0, 2048), (("Q4_K", 2048), ("Q6_K", 1024))):
        layer.load_rows(row, GGUFBlocks(random_blocks(kind, n, k, seed=n, small=True), Q[kind], n, k))
    layer.bias = torch.nn.Parameter(torch.randn(3072, device="cuda").bfloat16(), requires_grad=False)
    assert len(layer.parts) == 2
    x = torch.randn(m, k, device="cuda").bfloat16()
    got = layer(x)
    ref = layer.cpu()(x.cpu().float())
    assert got.dtype == torch.bfloat16
    assert _error(got.cpu(), ref.double()) <= BOUND[torch.bfloat16]


MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
       "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q4_K", "output": "Q6_K"}


def test_q4_k_m_like_model_greedy_against_dequantised_bf16(tmp_path):
    from gguf import GGUFReader

    from minisrv import LLM, SamplingParams

    from ..helpers.gguf_writer import write_gguf
    from ..helpers.tiny_models import build_tiny_model, make_prompts, vocab_of
    hf = build_tiny_model(str(tmp_path / "hf"), "llama", hidden_size=512, intermediate_size=1536,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    gguf = str(tmp_path / "tiny-q4_k_m.gguf")
    write_gguf(hf, gguf, "llama", quant=lambda name: "Q4_K" if name.startswith("blk.1.") and name.endswith(
        ("attn_v.weight", "ffn_down.weight")) else MIX[name.split(".")[-2]])
    prompts = make_prompts(vocab_of(hf), [5, 40, 130, 300])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = {}
    for weights in ("float32", "auto"):  # dequantised to the model's dtype, then kept in planes
        llm = LLM(model=gguf, tokenizer=hf, dtype="bfloat16", cache_dir="off", gguf_weights=weights,
                  max_total_tokens=8192, log_level="warning")
        try:
            model = llm.engine.runner.model
            planes = [m for m in model.modules() if isinstance(m, PlanesLinear)]
            if weights == "auto":
                assert len(planes) == 2 * 4 + 2 and llm.engine.runner.graph_runner is not None
                matrices = sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors if len(t.shape) == 2)
                held = sum(p.numel() * p.element_size() for m in planes for n, p in m.named_parameters()
                           if n.startswith("part"))
                assert held <= 1.1 * matrices
            else:
                assert not planes
            outs[weights] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.close()
            del llm
            free_cuda()
    assert_same_up_to_ties(outs["float32"], outs["auto"], "GGUF planes against the dequantised bf16 model")
    assert np.mean([a.token_ids == b.token_ids for a, b in zip(outs["float32"], outs["auto"])]) >= 0.5
