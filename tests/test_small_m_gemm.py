"""The small-batch decode GEMM (minisrv/models/small_m_gemm.py) where the CPU can check it: its launch parameters
keep the kernel's contract, and --decode-gemm triton changes nothing but which kernel runs on CUDA (the kernel
itself is checked against cuBLAS and float64 in tests/gpu/test_fp8_weights.py)."""
from __future__ import annotations

import pytest
import torch

from .conftest import EngineWatch, greedy, make_llm, make_prompts, vocab_of


def test_small_batch_launch_parameters_respect_the_kernel_contract():
    """The kernel loops over K in steps of block_k with no tail: every default it is given must divide K (the layers
    send it only K where `fits`), for any kind, shape and batch."""
    from minisrv.models.small_m_gemm import KINDS, SMALL_M, default_config, fits
    for k in (128, 384, 2048, 4096, 7168, 14336, 13824 + 128):
        assert fits(k)
        for n in (64, 3072, 4096, 6144, 8192, 14336, 28672):
            for m in (1, 2, 16, 17, SMALL_M):
                for kind in KINDS:
                    c = default_config(kind, n, k, m)
                    assert k % c.block_k == 0 and c.block_n in (16, 32, 64, 128) and c.num_warps in (2, 4, 8), \
                        (kind, n, k, m, c)
    assert not fits(100) and not fits(64)


def test_small_batch_linear_is_nn_linear_off_cuda(tiny_model):
    """--decode-gemm triton swaps the projections' class, nothing else: same parameters, and off CUDA the layers
    take F.linear (with the bias), so the logits are the same. (The kernel itself runs only on CUDA: it is checked
    against cuBLAS in tests/gpu/test_fp8_weights.py.)"""
    from minisrv.models.fp8 import LINEAR_NAMES
    from minisrv.models.small_m_gemm import SmallBatchLinear
    path = tiny_model("qwen2")  # qkv bias: SmallBatchLinear must keep adding it
    prompts = make_prompts(vocab_of(path), [5, 30, 12])
    logits = {}
    for gemm in ("cublas", "triton", "auto"):  # auto: the one-row kernel is for CUDA only, so nn.Linear here
        llm = make_llm(path, decode_gemm=gemm, dtype="bfloat16")
        model = llm.engine.runner.model
        kinds = {type(getattr(mod, n)) for mod in model.modules() for n in LINEAR_NAMES if hasattr(mod, n)}
        assert kinds == ({SmallBatchLinear} if gemm == "triton" else {torch.nn.Linear})
        watch = EngineWatch(llm.engine)
        llm.generate(prompts, greedy(4), use_tqdm=False)
        logits[gemm] = [t for steps in watch.logits.values() for _, t in steps]  # in the order first seen
    assert len(logits["cublas"]) == len(logits["triton"]) == len(logits["auto"]) == 3 * 4
    assert all(torch.equal(a, b) and torch.equal(a, c)
               for a, b, c in zip(logits["cublas"], logits["triton"], logits["auto"]))
    with pytest.raises(ValueError, match="decode_gemm"):
        make_llm(path, decode_gemm="cutlass")


def test_fp8_linear_takes_activations_quantised_before_it():
    """A fused norm or SiLU-and-mul hands Fp8Linear its input already quantised (Fp8Activations): the product must
    be the one Fp8Linear computes when it quantises the same input itself, bias included."""
    from minisrv.models.fp8 import Fp8Activations, Fp8Linear, quantize_rows
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(5, 256)
    direct = layer(x)
    handed = layer(Fp8Activations(*quantize_rows(x)))
    assert handed.shape == direct.shape == (5, 96)
    assert torch.equal(handed, direct)
    exact = linear(x)  # and both are the float product up to e4m3's rounding of weights and inputs
    assert (direct - exact).abs().max() <= 0.1 * exact.abs().max()


def test_only_norms_before_fp8_projections_quantise_their_output(tiny_model):
    """The norms before qkv and gate/up hand over FP8 activations only where those projections are FP8 layers."""
    from minisrv.models.fp8 import NORMS_BEFORE_PROJECTIONS, Fp8Linear
    path = tiny_model("llama")
    for quantization in ("fp8", None):
        model = make_llm(path, quantization=quantization).engine.runner.model
        layers = [m for m in model.modules() if hasattr(m, "input_layernorm")]
        assert layers
        for layer in layers:
            for norm, (block, projection) in NORMS_BEFORE_PROJECTIONS.items():
                fp8 = isinstance(getattr(getattr(layer, block), projection), Fp8Linear)
                assert fp8 == (quantization == "fp8")
                assert getattr(layer, norm).quantize_out == fp8


def test_a_gpu_models_table_of_launch_parameters_is_used_where_it_has_the_shape(tmp_path):
    """A sweep's table (small_m_configs/<GPU>.json) overrides the rules for the shapes and batch sizes it holds,
    a batch taking the entry of the next tuned size up; other shapes keep `default_config`; an entry whose K step
    does not divide its K is refused. Every table shipped keeps the kernel's contract."""
    import glob
    import json
    import os
    from minisrv.models.small_m_gemm import CONFIG_DIR, TUNED_M, SmallMConfig, config_file, tuned_configs, tuned_key
    gpu = "Some GPU 80GB"
    assert os.path.basename(config_file(gpu)) == "Some_GPU_80GB.json"
    with open(config_file(gpu, str(tmp_path)), "w") as f:
        json.dump({"fp8 28672x4096 64": [128, 128, 8, 4], "fp8 28672x4096 16": [64, 256, 4, 3]}, f)
    table = tuned_configs(gpu, str(tmp_path))
    assert table[tuned_key("fp8", 28672, 4096, 40)] == SmallMConfig(128, 128, 8, 4)
    assert table[tuned_key("fp8", 28672, 4096, 9)] == SmallMConfig(64, 256, 4, 3)
    assert tuned_key("fp8", 28672, 4096, 1) not in table and tuned_key("fp8", 4096, 4096, 64) not in table
    assert tuned_configs("Another GPU", str(tmp_path)) == {}
    with open(config_file("Bad GPU", str(tmp_path)), "w") as f:
        json.dump({"fp8 4096x13952 64": [16, 256, 4, 4]}, f)  # 13952 is not a multiple of 256
    with pytest.raises(ValueError, match="do not divide"):
        tuned_configs("Bad GPU", str(tmp_path))
    with open(config_file("Split GPU", str(tmp_path)), "w") as f:  # K split over 4 slices of K steps
        json.dump({"fp8 4096x4096 16": [32, 256, 4, 3, 4]}, f)
    assert tuned_configs("Split GPU", str(tmp_path))["fp8 4096x4096 16"] == SmallMConfig(32, 256, 4, 3, split_k=4)
    with open(config_file("Split bad GPU", str(tmp_path)), "w") as f:
        json.dump({"fp8 4096x3968 16": [32, 128, 4, 3, 4]}, f)  # 3968 = 31 x 128: not 4 slices of K steps
    with pytest.raises(ValueError, match="4096x3968"):
        tuned_configs("Split bad GPU", str(tmp_path))
    with open(config_file("Gemv GPU", str(tmp_path)), "w") as f:  # the one-row kernel, for m = 1 only
        json.dump({"bf16 4096x7168 1": [8, 512, 4, 3, 2, True], "bf16 7168x4096 16": [8, 512, 4, 3, 1, True]}, f)
    with pytest.raises(ValueError, match="7168x4096 16"):
        tuned_configs("Gemv GPU", str(tmp_path))
    with open(config_file("Gemv GPU 2", str(tmp_path)), "w") as f:
        json.dump({"bf16 4096x7168 1": [8, 512, 4, 3, 2, True]}, f)
    assert tuned_configs("Gemv GPU 2", str(tmp_path))[tuned_key("bf16", 4096, 7168, 1)] == SmallMConfig(
        8, 512, 4, 3, 2, gemv=True)
    for path in glob.glob(os.path.join(CONFIG_DIR, "*.json")):
        with open(path) as f:
            for key, value in json.load(f).items():
                kind, shape, m = key.split()
                k = int(shape.split("x")[1])
                c = SmallMConfig(*value)
                assert kind in ("fp8", "bf16") and int(m) in TUNED_M and k % (c.block_k * c.split_k) == 0, (path, key)
                assert c.split_k in (1, 2, 4), (path, key)
                # the dot kernel's tiles are 16 columns or more; the one-row kernel's may be narrower
                assert c.block_n in ((4, 8, 16, 32) if c.gemv else (16, 32, 64, 128)), (path, key)
                assert not c.gemv or m == "1", (path, key)


def test_auto_takes_the_one_row_kernel_only_where_a_gpus_table_tunes_it():
    """--decode-gemm auto: a projection takes the one-row kernel for one row where the GPU's table gives it for the
    shape (the H200's and H100's sweeps: tp 2's Llama-3-8B qkv on both), never for more rows, and never on a GPU
    without a table (cuBLAS there)."""
    from minisrv.models.small_m_gemm import SmallBatchLinear, config_for
    assert config_for("bf16", 3072, 4096, 1, "NVIDIA H200").gemv
    assert config_for("bf16", 3072, 4096, 1, "NVIDIA H100 80GB HBM3").gemv
    assert not config_for("bf16", 3072, 4096, 2, "NVIDIA H200").gemv
    assert not config_for("bf16", 3072, 4096, 1, "Some GPU").gemv
    layer = torch.nn.Linear(4096, 3072, bias=False, dtype=torch.bfloat16, device="meta")
    layer.__class__ = SmallBatchLinear
    layer.tuned_one_row_only = True
    x = torch.empty(1, 4096, dtype=torch.bfloat16, device="meta")
    assert layer.kernel_config(x) is None  # not CUDA
