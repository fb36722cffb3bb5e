"""4-bit checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized: models/w4a16.py, checkpoints/int4_formats.py)
on the CPU: tiny Llama / Qwen2 checkpoints quantised in each format (tests/helpers/int4_checkpoints.py: AWQ and GPTQ
packed as their documented packers do, compressed-tensors by its own library).

- the weights each layer holds, dequantised, equal a float64 reading of the format's specification exactly;
- the logits of every step are within 1e-4 of HF transformers' (float64) on the same checkpoint where transformers
  loads it on the CPU (compressed-tensors, symmetric), else on a float copy holding the dequantised weights, and the
  greedy tokens are HF's;
- formats minisrv does not serve are refused at start with the format named;
- two tensor-parallel ranks over gloo split the packed weights (rows of K at group boundaries);
- the Triton kernel under the interpreter (helpers/w4a16_interpreted_checks.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

from minisrv.checkpoints.loader import ModelBuild, WeightLoadError, load_model, load_model_args
from minisrv.kernels.w4a16_gemm import dequantize, pack_rows
from minisrv.models.w4a16 import Int4Scheme, Int4Weight, W4A16Linear, int4_scheme

from .helpers import EngineWatch, assert_greedy_matches, greedy, hf_greedy, make_llm, make_prompts, vocab_of
from .helpers.int4_checkpoints import spec_dequantised, write_dequantised_checkpoint, write_int4_checkpoint
from .helpers.interpreted import needs_triton, run_checks

needs_ct = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                              reason="compressed-tensors is not installed")

# id -> (method, group size (0: per channel), symmetric, act order, gptq_v2)
FORMATS = {
    "awq-g32": ("awq", 32, False, False, False),
    "awq-channel": ("awq", 0, False, False, False),
    "gptq-g32-sym-desc_act": ("gptq", 32, True, True, False),
    "gptq-g64-asym": ("gptq", 64, False, False, False),
    "gptq_v2-channel-asym": ("gptq", 0, False, False, True),
    "ct-g32-asym": ("compressed-tensors", 32, False, False, False),
    "ct-g64-sym": ("compressed-tensors", 64, True, False, False),
    "ct-channel-asym": ("compressed-tensors", 0, False, False, False),
}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _params(ids):
    return [pytest.param(i, marks=needs_ct) if i.startswith("ct") else i for i in ids]


def _write(tiny_model, tmp_path, fmt: str, arch: str = "llama"):
    method, group, sym, act_order, v2 = FORMATS[fmt]
    dst = str(tmp_path / f"{arch}-{fmt}")
    return dst, write_int4_checkpoint(tiny_model(arch), dst, method, group, sym, act_order, v2)


def _held_weights(model):
    """HF name -> the [N, K] float64 weight a W4A16 layer multiplies by (its fused parts split apart)."""
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, W4A16Linear):
            continue
        w = dequantize(m.qweight, m.scales, m.zeros, torch.float64)  # [K, N], rows in the layer's order
        if m.perm is not None:
            w = torch.empty_like(w).index_copy_(0, m.perm, w)
        owner, _, leaf = name.rpartition(".")
        parts = [f"{owner}.{sub}.weight" for sub in FUSED.get(leaf, (leaf,))]
        out.update(zip(parts, w.t().split([_out_rows(p, model.args) for p in parts])))
    return out


def _out_rows(hf_name: str, a) -> int:
    kv = a.num_kv_heads * a.head_dim
    return {"q_proj": a.num_heads * a.head_dim, "k_proj": kv, "v_proj": kv, "gate_proj": a.intermediate_size,
            "up_proj": a.intermediate_size, "o_proj": a.hidden_size, "down_proj": a.hidden_size}[hf_name.split(".")[-2]]


@pytest.mark.parametrize("fmt", _params(FORMATS))
def test_weights_equal_the_specification(tiny_model, tmp_path, fmt):
    """Each layer's 4-bit weight, dequantised, is exactly the float64 reading of the format's tensors; and that
    reading is the quantised original (within 4-bit rounding), and for compressed-tensors the library's own
    decompression."""
    from safetensors.torch import load_file
    path, spec = _write(tiny_model, tmp_path, fmt)
    model = load_model(path, ModelBuild(load_model_args(path), torch.float32, torch.device("cpu"), 256)).model
    held = _held_weights(model)
    assert held.keys() == spec.keys() and len(spec) == 7 * model.args.num_layers
    original = load_file(os.path.join(tiny_model("llama"), "model.safetensors"))
    for name, w in spec.items():
        assert torch.equal(held[name], w), f"{fmt}: {name} differs from the specification's reading"
        err = (torch.linalg.vector_norm(w - original[name].double()) / torch.linalg.vector_norm(original[name])).item()
        assert err < 0.15, f"{fmt}: {name} is {err:.3f} from the unquantised weight"
    assert all(isinstance(m, torch.nn.Linear) for m in [model.lm_head])  # left in the model's dtype
    if FORMATS[fmt][0] == "compressed-tensors":
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

        from .helpers.int4_checkpoints import _ct_scheme
        stored = load_file(os.path.join(path, "model.safetensors"))
        prefix = "model.layers.1.mlp.down_proj"
        parts = {k.rpartition(".")[2]: v for k, v in stored.items() if k.startswith(prefix + ".")}
        _, group, sym, _, _ = FORMATS[fmt]
        theirs = PackedQuantizationCompressor.decompress(parts, _ct_scheme(group, sym))["weight"]
        # (the library multiplies in the scales' float32: one rounding of the exact product)
        assert torch.equal(theirs, spec_dequantised("compressed-tensors", parts).to(theirs.dtype))


@pytest.mark.parametrize("fmt,arch", [("awq-g32", "llama"), ("gptq-g32-sym-desc_act", "qwen2"),
                                      ("gptq_v2-channel-asym", "llama"), pytest.param("ct-g64-sym", "qwen2",
                                                                                      marks=needs_ct),
                                      pytest.param("ct-g32-asym", "llama", marks=needs_ct)])
def test_generation_matches_hf(tiny_model, tmp_path, fmt, arch):
    """Greedy tokens and every step's logits against HF (float64): on the 4-bit checkpoint itself where
    transformers runs it on the CPU (symmetric compressed-tensors), else on the float copy of its dequantised
    weights."""
    path, spec = _write(tiny_model, tmp_path, fmt, arch)
    reference = path
    if not (fmt.startswith("ct") and FORMATS[fmt][2]):
        reference = str(tmp_path / "dequantised")
        write_dequantised_checkpoint(tiny_model(arch), reference, spec)
    prompts = make_prompts(vocab_of(path), [5, 30, 12])
    llm = make_llm(path)
    layers = llm.engine.parts.args.num_layers
    assert sum(isinstance(m, W4A16Linear) for m in llm.engine.runner.model.modules()) == 4 * layers
    assert_as_reference(llm, prompts, reference, fmt)


def _with_config(tiny_model, tmp_path, qc: dict) -> str:
    dst = str(tmp_path / "edited")
    shutil.copytree(tiny_model("llama"), dst, dirs_exist_ok=True)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"GPTQ checkpoint \(3-bit"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"GPTQ checkpoint \(8-bit"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format marlin"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"AWQ checkpoint \(4-bit, gemv layout"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv_fast"}, "gemv_fast layout"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}, "compressed-tensors checkpoint"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int"}}}}, "int-quantized"),
    ({"quant_method": "bitsandbytes"}, "unsupported checkpoint quantization 'bitsandbytes'"),
])
def test_unserved_formats_are_named(tiny_model, tmp_path, qc, named):
    with pytest.raises(WeightLoadError, match=named):
        load_model_args(_with_config(tiny_model, tmp_path, qc))


def assert_as_reference(llm, prompts, reference, what: str) -> None:
    """Greedy tokens as HF's on the float reference, and every step's logits near its, the pool checked."""
    watch = EngineWatch(llm.engine)
    outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    watch.assert_idle()
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref, scores = hf_greedy(reference, p, 8)
        assert_greedy_matches(o.token_ids, ref, scores, f"{what} prompt {i}")
    assert watch.check_logits(reference) >= len(prompts) * 8


def test_detection():
    assert int4_scheme(None) is None and int4_scheme({"quant_method": "fp8"}) is None
    assert int4_scheme({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                        "version": "GEMM"}) == Int4Scheme("awq", 128, False)
    assert int4_scheme({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True, "sym": True}) == \
        Int4Scheme("gptq", 0, True, zero_plus_one=True, act_order=True)
    assert not int4_scheme({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}).zero_plus_one


def test_partly_quantised_checkpoints_are_refused(tiny_model, tmp_path):
    """A projection the checkpoint leaves in float, and a 4-bit lm_head, are named (their layers are built for one
    kind); so is --quantization fp8 on a 4-bit checkpoint."""
    from safetensors.torch import load_file, save_file
    path, _ = _write(tiny_model, tmp_path, "awq-g32")
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    good = dict(state)
    for leaf in ("qweight", "qzeros", "scales"):
        del state[f"model.layers.1.mlp.down_proj.{leaf}"]
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 128)
    save_file(state, file)
    with pytest.raises(WeightLoadError, match="'model.layers.1.mlp.down_proj.weight' is not quantised"):
        make_llm(path)
    state = dict(good)
    for leaf in ("qweight", "qzeros", "scales"):
        state[f"lm_head.{leaf}"] = state[f"model.layers.0.self_attn.q_proj.{leaf}"].clone()
    save_file(state, file)
    with pytest.raises(WeightLoadError, match="'lm_head' is quantised in this checkpoint"):
        make_llm(path)
    with pytest.raises(ValueError, match="--quantization fp8 cannot requantise this awq 4-bit checkpoint"):
        make_llm(path, quantization="fp8")


def test_layer_against_float64():
    """W4A16Linear's product (the CPU path) with a bias and an activation order, filled in two column blocks as a
    fused projection is, against x @ W + b in float64."""
    torch.manual_seed(0)
    k, n, group = 128, 48, 32
    layer = W4A16Linear(k, n, True, Int4Scheme("gptq", group, False, act_order=True, scale_dtype=torch.float16))
    values = torch.randint(0, 16, (k, n), dtype=torch.uint8)
    scales = (torch.rand(k // group, n) * 0.1).half()
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8)
    perm = torch.randperm(k)
    for c0, c1 in ((0, 16), (16, n)):
        layer.load_rows(c0, Int4Weight(pack_rows(values[:, c0:c1]), scales[:, c0:c1], zeros[:, c0:c1], perm))
    layer.bias.data = torch.randn(n)
    x = torch.randn(3, 5, k)
    w = (values.double() - zeros.double().repeat_interleave(group, 0)) * scales.double().repeat_interleave(group, 0)
    ref = x.double()[..., perm] @ w + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="different activation orders"):
        layer.load_rows(0, Int4Weight(pack_rows(values[:, :16]), scales[:, :16], zeros[:, :16], torch.randperm(k)))
    with pytest.raises(ValueError, match="not whole groups of 128"):
        W4A16Linear(64, 16, False, Int4Scheme("gptq", 128, True))


@pytest.mark.slow  # spawns a tensor-parallel rank
def test_two_ranks(tiny_model, tmp_path):
    """tp 2 over gloo: q/k/v and gate/up split by output columns, o and down by rows of K at group boundaries;
    logits and tokens as HF's on the dequantised weights. Activation order cannot be split along K: refused."""
    path, spec = _write(tiny_model, tmp_path, "gptq-g32-sym-desc_act")
    with pytest.raises(Exception, match="activation-order"):
        make_llm(path, tp_size=2)
    path, spec = _write(tiny_model, tmp_path, "awq-g32")
    reference = str(tmp_path / "dequantised")
    write_dequantised_checkpoint(tiny_model("llama"), reference, spec)
    prompts = make_prompts(vocab_of(path), [5, 30, 12])
    with make_llm(path, tp_size=2) as llm:
        assert_as_reference(llm, prompts, reference, "tp 2")


@needs_triton
def test_triton_kernel_under_the_interpreter():
    out = run_checks("w4a16_interpreted_checks.py")
    assert out.count("W4A16 GEMM") == 57 and out.count("W4A16 expert pairs") == 3
