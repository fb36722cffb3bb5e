"""A GGUF model's blocks kept as planes for the GPU's W4A16 GEMM (models/gguf_planes.py, planes_layers.py,
kernels/w4a16_gemm.py), checked on the CPU: the kernel under Triton's interpreter against gguf's dequantisation of
the same bytes; the planes' values against gguf's and a float64 reading of the format, their bytes against the
file's; a model's layers (fused projections joining types, tensor-parallel shares) against the same file loaded
dequantised; a whole model through the layers' torch path against the dequantised one, greedy tokens and logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from minisrv.checkpoints import loader
from minisrv.checkpoints.checkpoint import StoredTensor, WeightLoadError
from minisrv.checkpoints.gguf_file import iter_gguf
from minisrv.checkpoints.loader import ModelBuild, empty_model, load_model_args, load_weights
from minisrv.distributed import TensorParallel
from minisrv.kernels.w4a16_gemm import dequantize_planes
from minisrv.models.gguf_blocks import GGUFBlocks
from minisrv.models.gguf_planes import PLANE_FORMATS, to_planes
from minisrv.models.planes_layers import PlanesLinear

from .helpers.gguf_writer import write_gguf
from .helpers.interpreted import needs_triton, run_checks
from .helpers.kquant_blocks import BLOCK, dequantize_f64, random_blocks
from .helpers.tiny_models import build_tiny_model, make_llm, make_prompts, vocab_of

KINDS = [Q(k).name for k in PLANE_FORMATS]


@needs_triton
def test_gemm_over_planes_under_the_interpreter():
    out = run_checks("gguf_planes_interpreted_checks.py")
    for kind in KINDS:
        for m in (1, 2, 5, 64, 130):
            assert f"GGUF {kind} GEMM m={m} n=72 k=512 float16" in out
        assert f"GGUF {kind} GEMM m=20 n=40 k=256 float16 launch rule into a slice" in out
    for kind in ("Q4_K", "Q6_K", "Q8_0", "Q4_1"):
        assert f"GGUF {kind} GEMM m=5 n=100 k=768 float16 (8, 64, 32, 2, 2, 2)" in out


@pytest.mark.parametrize("kind", KINDS)
def test_planes_hold_the_blocks_values_in_the_files_bytes(kind):
    """Every value as gguf reads it (to the bit in float32 for Q4_0, Q4_1, Q8_0; the others exactly as a float64
    reading of the format, which gguf rounds to float32), rows taken in any order and columns split at blocks; at
    most 1.1x the file's bytes."""
    rows, cols = 12, 1024
    raw = random_blocks(kind, rows, cols, seed=len(kind) * 7 + cols)
    want = dequantize(raw, Q[kind]).astype(np.float64).reshape(rows, cols)
    order = torch.tensor([5, 0, 11, 3, 2, 1, 4, 10, 9, 8, 6, 7])
    blocks = GGUFBlocks(raw, Q[kind], rows, cols).take_rows(order)
    planes = to_planes(blocks.data, blocks.kind, blocks.rows, blocks.cols, blocks.src_rows, torch.device("cpu"))
    got = dequantize_planes(planes, torch.float64).t().numpy()
    assert np.allclose(got, want[order.numpy()], rtol=0, atol=2e-7 * np.abs(want).max())
    if kind in BLOCK:
        assert np.array_equal(got, dequantize_f64(raw, kind, rows, cols)[order.numpy()])
    else:  # gguf's float32 arithmetic, to the bit
        assert np.array_equal(dequantize_planes(planes).t().numpy(), want[order.numpy()])
    held = sum(t.numel() * t.element_size() for t in planes[1:] if t is not None)
    assert held <= 1.1 * raw.nbytes
    share = blocks.narrow(1, 256, 512)
    part = to_planes(share.data, share.kind, share.rows, share.cols, share.src_rows, torch.device("cpu"))
    assert np.array_equal(dequantize_planes(part, torch.float64).t().numpy(), got[:, 256:768])


def test_a_share_that_splits_a_block_is_refused():
    raw = random_blocks("Q4_K", 4, 512, seed=3)
    with pytest.raises(ValueError, match="split its 256-weight blocks"):
        GGUFBlocks(raw, Q.Q4_K, 4, 512).narrow(1, 0, 128)


MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
       "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q4_K", "output": "Q8_0"}


def _mix(name: str) -> str:
    if name.startswith("blk.1.") and name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q4_K"  # llama.cpp's Q4_K_M widens attn_v and ffn_down in some layers only
    return MIX[name.split(".")[-2]]


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    """(HF dir, a GGUF written from it in a Q4_K_M-like mix)."""
    d = tmp_path_factory.mktemp("planes")
    hf = build_tiny_model(str(d / "hf"), "llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=64, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 10000.0})
    gguf = str(d / "tiny-mix.gguf")
    write_gguf(hf, gguf, "llama", quant=_mix)
    return hf, gguf


def _loaded(gguf: str, rank: int, size: int, planes: bool):
    args = load_model_args(gguf, cache_dir="off")
    tp = TensorParallel(rank, size)  # (loading only: no collective is called)
    model = empty_model(ModelBuild(args, torch.float32, torch.device("cpu"), 64, tp=tp,
                                   quantization="gguf-planes" if planes else None))
    load_weights(model, ((n, StoredTensor.in_memory(w)) for n, w in iter_gguf(gguf, args, None, planes)), args,
                 model.plan)
    return model


@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_layers_hold_the_dequantised_models_matrices(mixed_model, rank, size):
    """Each planes layer (a rank's share under tensor parallelism: rows of q/k/v, gate/up, the vocabulary; whole
    blocks of K of o and down) dequantises to the matrix the dequantising load gives that rank, and multiplies as
    it; layer 0's qkv and down join Q4_K and Q6_K rows, layer 1's are one type."""
    _, gguf = mixed_model
    ours, ref = _loaded(gguf, rank, size, True), _loaded(gguf, rank, size, False)
    layers = {n: m for n, m in ours.named_modules() if isinstance(m, PlanesLinear)}
    assert len(layers) == 2 * 4 + 2
    assert len(ours.model.layers[0].self_attn.qkv_proj.parts) == 2
    assert len(ours.model.layers[1].self_attn.qkv_proj.parts) == 1
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(rank))
    for name, layer in layers.items():
        want = ref.get_submodule(name).weight
        w = torch.zeros_like(want)
        for row, p in layer.parts:
            w[row:row + p.low.shape[1]] = dequantize_planes(p).t()
        assert torch.equal(w, want), name
        if name != "model.embed_tokens":
            xi = x[:, :layer.in_features]
            assert torch.allclose(layer(xi), xi @ want.t(), rtol=1e-5, atol=1e-5), name
    ids = torch.tensor([[0, 5], [191, 100]])  # this rank's rows (the split's all-reduce is VocabEmbedding's)
    ours.model.embed_tokens.tp = ref.model.embed_tokens.tp = TensorParallel.single()
    rows = ours.model.embed_tokens(ids)
    assert torch.equal(rows, ref.model.embed_tokens(ids)) and rows.is_contiguous()


def test_tp_share_of_o_that_splits_blocks_is_refused(tmp_path):
    hf = build_tiny_model(str(tmp_path / "hf"), "llama", hidden_size=256, intermediate_size=512,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    gguf = str(tmp_path / "m.gguf")
    write_gguf(hf, gguf, "llama", quant=lambda name: "Q4_K")
    with pytest.raises(WeightLoadError, match=r"o_proj.weight.*split its 256-weight blocks"):
        _loaded(gguf, 0, 2, True)


def _run(llm, prompts, n):
    from minisrv import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def test_model_in_planes_generates_as_the_dequantised_model(mixed_model, monkeypatch):
    """The engine over planes layers (their torch path: the CPU has no Triton kernel launch) against the same file
    dequantised: greedy tokens equal, logprobs within 1e-4; the planes take at most 1.1x the file's matrices."""
    hf, gguf = mixed_model
    ref = make_llm(gguf, tokenizer=hf, cache_dir="off", gguf_weights="float32")
    prompts = make_prompts(vocab_of(hf), [9, 30, 4])
    try:
        want, want_lp = _run(ref, prompts, 8)
    finally:
        ref.close()
    monkeypatch.setattr(loader, "_keep_blocks", lambda *a: ("gguf-planes", None))
    llm = make_llm(gguf, tokenizer=hf, cache_dir="off")
    try:
        model = llm.engine.runner.model
        assert isinstance(model.lm_head, PlanesLinear)
        from gguf import GGUFReader
        matrices = sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors if len(t.shape) == 2)
        held = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".part" in f".{n}")
        assert held <= 1.1 * matrices
        got, got_lp = _run(llm, prompts, 8)
        assert got == want
        assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-4
    finally:
        llm.close()


def test_bench_maker_writes_a_q4_k_m_mix_that_serves(tmp_path, monkeypatch):
    """scripts/make_gguf_checkpoint.py (the GPU benchmark's file, here a small shape): llama.cpp's Q4_K_M types by
    layer, a vocabulary in the file that the engine starts on, served through the planes layers."""
    import subprocess
    import sys

    from gguf import GGUFReader

    from minisrv import SamplingParams
    out = str(tmp_path / "bench.gguf")
    subprocess.run([sys.executable, "scripts/make_gguf_checkpoint.py", out, "--layers", "8", "--hidden", "256",
                    "--inter", "512", "--vocab", "640"], check=True, capture_output=True)
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    wide = [i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert wide == [0, 3, 6, 7] and all(types[f"blk.{i}.ffn_down.weight"] == "Q6_K" for i in wide)
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == types["blk.1.ffn_up.weight"] == "Q4_K"
    monkeypatch.setattr(loader, "_keep_blocks", lambda *a: ("gguf-planes", None))
    llm = make_llm(out, cache_dir="off")
    try:
        assert isinstance(llm.engine.runner.model.lm_head, PlanesLinear)
        outs = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        assert len(outs[0].token_ids) == 4
    finally:
        llm.close()


def test_cuda_keeps_blocks_of_16_bit_dense_models_of_its_types(mixed_model):
    """The loader's choice on CUDA (no GPU needed to decide): planes for a bf16/fp16 model without experts, any tp
    size, where Triton is; a file with a matrix of another type (a float one) is named."""
    from dataclasses import replace
    from types import SimpleNamespace

    from minisrv.checkpoints.gguf_file import hf_name
    from minisrv.models.gguf_blocks import blocks_unavailable_here, blocks_unavailable_in
    args, cuda, launcher = load_model_args(mixed_model[1], cache_dir="off"), torch.device("cuda"), object()
    assert blocks_unavailable_here(args, cuda, torch.bfloat16, True, None, launcher) is None
    assert blocks_unavailable_here(args, cuda, torch.float16, False, None, launcher) is None
    assert "16-bit" in blocks_unavailable_here(args, cuda, torch.float32, False, None, launcher)
    assert "fp8" in blocks_unavailable_here(args, cuda, torch.bfloat16, False, "fp8", launcher)
    assert "Triton" in blocks_unavailable_here(args, cuda, torch.bfloat16, False, None, None)
    assert "experts" in blocks_unavailable_here(replace(args, num_experts=8), cuda, torch.bfloat16, False, None,
                                                launcher)

    def file(kind):
        return SimpleNamespace(tensors=[SimpleNamespace(name="output.weight", tensor_type=kind, shape=[512, 6])])
    assert blocks_unavailable_in(file(Q.Q6_K), hf_name, gpu=True) is None
    assert "output.weight is F16" in blocks_unavailable_in(file(Q.F16), hf_name, gpu=True)
    assert "rows" in blocks_unavailable_in(file(Q.Q6_K), hf_name)  # the CPU's records need rows in fours
