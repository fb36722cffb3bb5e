"""4-bit mixtures of experts (models/w4a16.W4A16Experts, kernels/moe_w4a16.py) on the CPU: tiny Qwen3-MoE, Mixtral
(and Qwen2-MoE, with its shared expert) checkpoints with every projection, experts included, in AWQ, GPTQ (act order
per expert) and compressed-tensors pack-quantized (tests/helpers/int4_checkpoints.py: the formats' documented
packing, compressed-tensors' own compressor); routers stay in the model's dtype.

- each expert's gate/up/down, dequantised from what the model holds, equals a float64 reading of the format's
  specification exactly (the experts stay 4-bit: int32 words, no float copy);
- greedy tokens and every step's logits as HF transformers' (float64) on a float copy holding those weights;
- tp 2 over gloo splits the packed experts (gate/up by columns, down by rows of K at group boundaries);
- a share of an expert that is not whole groups, and a 4-bit router, are refused with the reason;
- the grouped 4-bit kernel under Triton's interpreter (helpers/moe_w4a16_interpreted_checks.py).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from minisrv.checkpoints.loader import ModelBuild, WeightLoadError, load_model, load_model_args
from minisrv.kernels.w4a16_gemm import dequantize
from minisrv.models.w4a16 import Int4Scheme, W4A16Experts, W4A16Linear

from .helpers import make_llm, make_prompts, vocab_of
from .helpers.int4_checkpoints import int4_parts, write_dequantised_checkpoint, write_int4_checkpoint
from .helpers.interpreted import needs_triton, run_checks
from .test_w4a16 import assert_as_reference

needs_ct = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                              reason="compressed-tensors is not installed")

# id -> (arch, method, group size (0: per channel), symmetric, act order, gptq_v2). Groups divide every K: the
# experts' widths (Qwen3-MoE 32, Mixtral 48) and the dense layers'.
CASES = {
    "qwen3_moe-gptq-g32-sym-desc_act": ("qwen3_moe", "gptq", 32, True, True, False),
    "qwen3_moe-awq-g16": ("qwen3_moe", "awq", 16, False, False, False),
    "qwen3_moe-ct-g32-asym": ("qwen3_moe", "compressed-tensors", 32, False, False, False),
    "mixtral-gptq_v2-channel-asym": ("mixtral", "gptq", 0, False, False, True),
    "mixtral-awq-g16": ("mixtral", "awq", 16, False, False, False),
    "mixtral-ct-g16-sym": ("mixtral", "compressed-tensors", 16, True, False, False),
    "qwen2_moe-gptq-g16-asym": ("qwen2_moe", "gptq", 16, False, False, False),  # + a 4-bit shared expert
}
EXPERT_PARTS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _params(ids):
    return [pytest.param(i, marks=needs_ct) if "-ct-" in i else i for i in ids]


def _write(tiny_model, tmp_path, case: str):
    arch, method, group, sym, act_order, v2 = CASES[case]
    dst = str(tmp_path / case)
    return dst, write_int4_checkpoint(tiny_model(arch), dst, method, group, sym, act_order, v2)


def _held_expert_weights(model, arch: str):
    """HF name -> the [N, K] float64 weight each expert multiplies by, from the 4-bit stacks the model holds."""
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, W4A16Experts):
            continue
        if arch == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        for which, subs in EXPERT_PARTS.items():
            packed = m.packed(which)
            assert packed.qweight.dtype == torch.int32 and packed.zeros.dtype == torch.uint8
            for e in range(packed.num_experts):
                w = dequantize(packed.qweight[e], packed.scales[e], packed.zeros[e], torch.float64)  # [K, N]
                if packed.perm is not None:
                    w = torch.empty_like(w).index_copy_(0, packed.perm[e], w)  # rows back in checkpoint order
                for sub, part in zip(subs, w.t().chunk(len(subs))):
                    out[f"{name}.{e}.{MIXTRAL[sub] if arch == 'mixtral' else sub}.weight"] = part
    return out


@pytest.mark.parametrize("case", _params(CASES))
def test_experts_equal_the_specification(tiny_model, tmp_path, case):
    """Every expert's 4-bit weights, dequantised, are exactly the float64 reading of the format's tensors; the
    experts are held in 4 bits and the routers in the model's dtype."""
    arch = CASES[case][0]
    path, spec = _write(tiny_model, tmp_path, case)
    model = load_model(path, ModelBuild(load_model_args(path), torch.float32, torch.device("cpu"), 256)).model
    held = _held_expert_weights(model, arch)
    experts = {n for n in spec if ".experts." in n}
    assert held.keys() == experts and len(experts) == 3 * model.args.num_experts * sum(
        isinstance(m, W4A16Experts) for m in model.modules())
    for name in experts:
        assert torch.equal(held[name], spec[name]), f"{case}: {name} differs from the specification's reading"
    for m in model.modules():
        if isinstance(m, W4A16Experts):  # no float weight beside the scales
            assert {n for n, p in m.named_parameters() if p.is_floating_point()} == {"w13_scales", "w2_scales"}
    routers = [m.gate for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    assert routers and all(type(r) is torch.nn.Linear and r.weight.dtype == torch.float32 for r in routers)


@pytest.mark.parametrize("case", _params(CASES))
def test_generation_matches_the_dequantised_model(tiny_model, tmp_path, case):
    """Greedy tokens and every step's logits against HF (float64) on the float copy of the dequantised weights;
    every projection of the served model is 4-bit (experts stacked, dense layers W4A16Linear)."""
    arch = CASES[case][0]
    path, spec = _write(tiny_model, tmp_path, case)
    reference = str(tmp_path / "dequantised")
    write_dequantised_checkpoint(tiny_model(arch), reference, spec)
    llm = make_llm(path)
    model = llm.engine.runner.model
    sparse = sum(isinstance(m, W4A16Experts) for m in model.modules())
    dense = sum(isinstance(m, W4A16Linear) for m in model.modules())
    mlps = model.args.num_layers - sparse + (sparse if model.args.shared_expert_intermediate_size else 0)
    assert sparse >= 1 and dense == 2 * model.args.num_layers + 2 * mlps
    assert_as_reference(llm, make_prompts(vocab_of(path), [5, 30, 12]), reference, case)


def test_a_share_of_whole_groups_is_required():
    """Experts whose width (or a rank's share of it) is not whole groups are refused with the reason."""
    with pytest.raises(ValueError, match="experts' 48-wide input .* not whole groups of 32: choose a tp size"):
        W4A16Experts(4, 64, 48, Int4Scheme("gptq", 32, True))
    with pytest.raises(ValueError, match="not whole groups of 8"):
        W4A16Experts(4, 64, 48, Int4Scheme("gptq", 8, True))


def test_a_quantised_router_is_refused(tiny_model, tmp_path):
    """A router stored in 4 bits is named (the router is kept in the model's dtype)."""
    from safetensors.torch import load_file, save_file
    path, _ = _write(tiny_model, tmp_path, "qwen3_moe-gptq-g32-sym-desc_act")
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    router = "model.layers.0.mlp.gate"
    for leaf, t in int4_parts(state.pop(f"{router}.weight"), "gptq", 32, True).items():
        state[f"{router}.{leaf}"] = t.contiguous()
    save_file(state, file)
    with pytest.raises(WeightLoadError, match=f"'{router}' is quantised in this checkpoint"):
        make_llm(path)


@pytest.mark.slow  # spawns a tensor-parallel rank
def test_two_ranks(tiny_model, tmp_path):
    """tp 2 over gloo: each expert's gate/up split by output columns, its down by rows of K at group boundaries
    (16 of each expert's 32 a rank); tokens and logits as HF's on the dequantised weights. Activation order cannot
    be split along K, nor a group of 32 into two ranks' 16: refused with the reason."""
    path, spec = _write(tiny_model, tmp_path, "qwen3_moe-awq-g16")
    reference = str(tmp_path / "dequantised")
    write_dequantised_checkpoint(tiny_model("qwen3_moe"), reference, spec)
    with make_llm(path, tp_size=2) as llm:
        assert_as_reference(llm, make_prompts(vocab_of(path), [5, 30, 12]), reference, "tp 2")
    path = str(tmp_path / "desc_act-g16")
    write_int4_checkpoint(tiny_model("qwen3_moe"), path, "gptq", 16, True, act_order=True)
    with pytest.raises(Exception, match="activation-order"):
        make_llm(path, tp_size=2)
    path, _ = _write(tiny_model, tmp_path, "qwen3_moe-gptq-g32-sym-desc_act")
    with pytest.raises(Exception, match="16-wide input .* not whole groups of 32: choose a tp size"):
        make_llm(path, tp_size=2)
    # a refused engine leaves this process without a process group, as it found it (a library that asks whether
    # torch.distributed is initialised would otherwise talk to ranks that are gone)
    assert not torch.distributed.is_initialized()


@needs_triton
def test_triton_kernel_under_the_interpreter():
    out = run_checks("moe_w4a16_interpreted_checks.py")
    assert out.count("4-bit experts") == 15 and out.count(" by pair: ") == 3
