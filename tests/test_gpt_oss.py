"""gpt-oss (GptOssForCausalLM) against HF transformers (float64) on tiny random checkpoints written by transformers' own
GptOssForCausalLM and save_pretrained (its stacked expert layout), and on one with MXFP4 experts in the hub's layout
(random bytes), whose reference is HF on the experts transformers' MXFP4 dequantisation makes of the same bytes.

Greedy tokens and the logits of every computed row, batched and alone, chunked prefill across the 8-token window,
the prefix cache on, two tensor-parallel ranks over gloo; the config as the hub writes it; YaRN against transformers;
MXFP4 dequantisation against transformers' and the specification; experts kept in MXFP4 against dequantised ones;
the registry giving sinks to torch and fa; the grouped GEMM's gpt-oss epilogue and MXFP4 tile under Triton's
interpreter. (The CPU kernel's sinks: tests/test_cpu_attention.py.)"""
from __future__ import annotations

import pytest
import torch

from minisrv.attention import BACKENDS, BackendUnavailable, resolve_backend
from minisrv.checkpoints.loader import load_model_args
from minisrv.models.args import ModelArgs
from minisrv.models.attention_options import SINKS, WINDOW, features_of, layer_attention

from .helpers import make_config, make_prompts, vocab_of
from .helpers.engine_modes import ENGINE_MODES, check_mode_against_hf, check_two_ranks
from .helpers.interpreted import needs_triton, run_checks

PROMPTS = [30, 5, 19, 44]  # past the 8-token window but one


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    """name -> (the checkpoint served, the one HF runs): transformers' layout, and MXFP4 with its dequantised twin."""
    from .helpers.gpt_oss_checkpoints import write_mxfp4_pair
    hf = tiny_model("gpt_oss")
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    return {"bf16_layout": (hf, hf), "mxfp4": write_mxfp4_pair(hf, str(root / "mxfp4"), str(root / "twin"))}


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
@pytest.mark.parametrize("layout", ["bf16_layout", "mxfp4"])
def test_greedy_and_logits_match_hf(checkpoints, layout, mode):
    path, ref = checkpoints[layout]
    check_mode_against_hf(path, ref, make_prompts(vocab_of(path), PROMPTS, seed=5), mode, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bf16_layout", "mxfp4"])
def test_two_ranks_give_hf_and_one_rank_tokens(checkpoints, layout):
    """Each rank reads its heads' q, k, v (biases and sinks too) and its share of every expert out of the stacked
    tensors (MXFP4: down's columns in whole blocks of 32); o's and down's biases are added once."""
    path, ref = checkpoints[layout]
    check_two_ranks(path, ref, make_prompts(vocab_of(path), PROMPTS, seed=7), layout)


def test_config_as_the_hub_writes_it(tiny_model):
    """transformers 5's config.json, and gpt-oss-20b's (rope_scaling beside a top-level rope_theta, layer_types,
    MXFP4 quantization_config): sliding layers, sinks, biases, YaRN, experts."""
    args = load_model_args(tiny_model("gpt_oss"))
    assert args.architecture == "GptOssForCausalLM" and args.sliding_layers == (0, 2) and args.sliding_window == 8
    assert args.attention_sinks and args.attention_bias and args.o_proj_bias and args.expert_bias
    assert (args.num_experts, args.experts_per_token, args.moe_intermediate_size) == (4, 2, 64)
    assert args.moe_layers == (0, 1, 2) and args.norm_topk_prob and args.swiglu_limit == 1.0
    assert args.rope_scaling["rope_type"] == "yarn" and args.rope_theta == 150000.0
    assert features_of(layer_attention(args)) == {WINDOW, SINKS}
    hub = make_config("gpt_oss").to_dict()
    hub.pop("rope_parameters")
    hub.update(rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                  "beta_slow": 1.0, "truncate": False,
                                                  "original_max_position_embeddings": 4096},
               quantization_config={"quant_method": "mxfp4"}, architectures=["GptOssForCausalLM"])
    got = ModelArgs.from_hf_config(hub)
    assert got.rope_theta == 150000.0 and got.rope_scaling["factor"] == 32.0 and not got.rope_scaling["truncate"]
    assert got.quantization_config["quant_method"] == "mxfp4" and got.swiglu_alpha == 1.702


@pytest.mark.parametrize("scaling", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 64},  # truncate (transformers' default), default betas
    {"factor": 8.0, "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 1.3, "beta_fast": 8.0},
])
def test_yarn_matches_transformers(scaling):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minisrv.models.layers import rope_inv_freq
    params = {"rope_type": "yarn", "rope_theta": 150000.0, **scaling}
    cfg = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=64, rope_parameters=dict(params))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got, factor = rope_inv_freq(64, 150000.0, params, 4096)
    assert torch.allclose(got, want.float(), rtol=1e-6) and factor == pytest.approx(want_factor, rel=1e-12)


def test_mxfp4_dequantisation_matches_transformers_and_the_specification():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from minisrv.kernels.moe_w4a16 import mxfp4_dequantize

    from .helpers.gpt_oss_interpreted_checks import mxfp4_float64
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 40, 128), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 40, 8), generator=gen, dtype=torch.uint8)
    ours = mxfp4_dequantize(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks.reshape(3, 40, 8, 16), scales, dtype=torch.float32)  # [E, K, N]
    assert torch.equal(ours, theirs.transpose(1, 2)) and torch.equal(ours.double(), mxfp4_float64(blocks, scales))
    assert torch.equal(mxfp4_dequantize(blocks, scales, torch.bfloat16).float(), ours)  # exact in bf16


def test_experts_kept_in_mxfp4_equal_the_dequantised_ones(checkpoints):
    """The loader's path for CUDA (experts left in MXFP4, rows read as bytes and exponents) run on the CPU through
    the experts' torch computation: the same outputs as the dequantised experts, for every layer."""
    from minisrv.checkpoints.gpt_oss_experts import gpt_oss_experts
    from minisrv.checkpoints.loader import ModelBuild, empty_model
    from minisrv.checkpoints.safetensors_files import iter_safetensors
    from minisrv.checkpoints.weights import load_weights
    from minisrv.kernels.fused_moe import route_reference

    path = checkpoints["mxfp4"][0]
    args = load_model_args(path)
    models = []
    for keep in (True, False):
        build = ModelBuild(args, torch.float32, torch.device("cpu"), 64, quantization="mxfp4" if keep else None)
        model = empty_model(build)
        load_weights(model, gpt_oss_experts(iter_safetensors(path), keep_mxfp4=keep), args, model.plan)
        models.append(model)
    x = torch.randn(7, args.hidden_size, generator=torch.Generator().manual_seed(1))
    for kept, dense in zip(*(m.model.layers for m in models)):
        assert kept.mlp.experts.mxfp4 and kept.mlp.experts.w13.dtype == torch.uint8
        weights, ids = route_reference(dense.mlp.gate(x), 2, True)
        assert torch.allclose(kept.mlp.experts(x, weights, ids), dense.mlp.experts(x, weights, ids), atol=1e-5)


def test_sinks_are_served_by_torch_and_fa(monkeypatch):
    """FlashInfer and the Triton decode kernel are refused for a model with sinks; auto goes to fa on SM90, to torch
    where fa cannot run. (fa's calls with sinks against HF: tests/test_fa_backend.py.)"""
    import minisrv.attention as registry
    for name, entry in BACKENDS.items():  # as if every backend could run here
        monkeypatch.setitem(BACKENDS, name, (lambda sm: None, *entry[1:]))
    monkeypatch.setattr(registry, "device_sm", lambda device: 90)
    cuda, sinks = torch.device("cuda"), frozenset({WINDOW, SINKS})
    for name in ("fi", "fa,fi", "fa,triton"):
        with pytest.raises(BackendUnavailable, match="does not serve learned attention sinks"):
            resolve_backend(name, cuda, sinks)
    assert [resolve_backend(n, cuda, sinks) for n in ("torch", "fa", "auto")] == ["torch", "fa", "fa"]
    monkeypatch.setitem(BACKENDS, "fa", (lambda sm: "no FA3 here", *BACKENDS["fa"][1:]))
    assert resolve_backend("auto", cuda, sinks) == "torch"


@needs_triton
def test_triton_kernel_under_the_interpreter():
    out = run_checks("gpt_oss_interpreted_checks.py")
    assert out.count("MXFP4") >= 8 and out.count("swiglu=True") >= 8 and out.count("pairs") == 3
