"""scripts/make_hub_checkpoint.py (the GPU benchmarks' gpt-oss-20b and Gemma-3-12B checkpoints), at its --tiny size:
the hub's tensor names, dtypes and shapes (gpt-oss's MXFP4 experts as `_blocks`/`_scales` uint8), a config minisrv
reads as the model's, a tokenizer the engine starts on, and greedy tokens equal to HF transformers' on the same
weights (gpt-oss: on the experts transformers' own MXFP4 dequantisation makes of the same bytes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from minisrv.checkpoints.loader import load_model_args

from .helpers import assert_greedy_matches, greedy, hf_greedy, make_llm, make_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-makers")

    def make(shape: str) -> str:
        out = str(root / shape)
        if not os.path.isdir(out):
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_hub_checkpoint.py"), shape, out,
                            "--tiny", "--device", "cpu"], check=True, capture_output=True)
        return out
    return make


def tensors(path: str):
    from safetensors.torch import load_file
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    return {k: v for name in files for k, v in load_file(os.path.join(path, name)).items()}


def dequantised_twin(path: str, twin: str) -> str:
    """path with its MXFP4 experts dequantised by transformers into its stacked [E, K, N] layout, no quantization."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    weights = tensors(path)
    for name in [k for k in weights if k.endswith("_blocks")]:
        base = name[:-len("_blocks")]
        weights[base] = convert_moe_packed_tensors(weights.pop(name), weights.pop(base + "_scales"),
                                                   dtype=torch.float32).contiguous()
    os.makedirs(twin)
    save_file(weights, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    with open(os.path.join(twin, "config.json"), "w") as f:
        json.dump(cfg, f)
    return twin


def test_gpt_oss_has_the_hubs_mxfp4_tensors_and_config(made):
    path = made("gpt-oss-20b")
    w = tensors(path)
    e, h, i = 4, 64, 64  # the tiny shape's experts, hidden and expert width
    p = "model.layers.1.mlp.experts."
    assert w[p + "gate_up_proj_blocks"].dtype == w[p + "gate_up_proj_scales"].dtype == torch.uint8
    assert w[p + "gate_up_proj_blocks"].shape == (e, 2 * i, h // 32, 16)
    assert w[p + "gate_up_proj_scales"].shape == (e, 2 * i, h // 32)
    assert w[p + "down_proj_blocks"].shape == (e, h, i // 32, 16) and w[p + "down_proj_scales"].shape == (e, h, i // 32)
    assert w[p + "gate_up_proj_bias"].shape == (e, 2 * i) and w[p + "gate_up_proj_bias"].dtype == torch.bfloat16
    assert not any(k.endswith(("gate_up_proj", "down_proj")) for k in w)
    assert w["model.layers.0.self_attn.sinks"].shape == (4,) and "lm_head.weight" in w
    assert 121 <= int(w[p + "down_proj_scales"].min()) and int(w[p + "down_proj_scales"].max()) <= 124
    args = load_model_args(path)
    assert args.architecture == "GptOssForCausalLM" and args.attention_sinks and args.sliding_layers == (0,)
    assert args.quantization_config["quant_method"] == "mxfp4" and args.rope_scaling["rope_type"] == "yarn"
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "gpt_oss"  # what selects the harmony chat format


def test_full_size_configs_are_the_released_models():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from make_hub_checkpoint import GEMMA_3_12B, GPT_OSS_20B
    finally:
        sys.path.pop(0)
    from minisrv.models.args import ModelArgs
    oss = ModelArgs.from_hf_config(GPT_OSS_20B)
    assert (oss.num_layers, oss.hidden_size, oss.num_heads, oss.num_kv_heads, oss.head_dim) == (24, 2880, 64, 8, 64)
    assert (oss.num_experts, oss.experts_per_token, oss.vocab_size) == (32, 4, 201088)
    assert oss.sliding_layers == tuple(range(0, 24, 2)) and oss.sliding_window == 128
    gemma = ModelArgs.from_hf_config(GEMMA_3_12B)
    assert (gemma.num_layers, gemma.hidden_size, gemma.num_heads, gemma.num_kv_heads, gemma.head_dim) == \
        (48, 3840, 16, 8, 256)
    assert len(gemma.sliding_layers) == 40 and 5 not in gemma.sliding_layers and gemma.sliding_window == 1024
    assert gemma.local_rope_theta == 1e4 and gemma.rope_theta == 1e6 and gemma.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("shape", ["gpt-oss-20b", "gemma-3-12b"])
def test_minisrv_serves_what_the_maker_writes_as_hf_does(made, shape, tmp_path):
    path = made(shape)
    ref = dequantised_twin(path, str(tmp_path / "twin")) if shape == "gpt-oss-20b" else path
    prompts = make_prompts(512, [3, 20], seed=3)  # the second past the 8-token window
    llm = make_llm(path)
    try:
        outs = llm.generate(prompts, greedy(6), use_tqdm=False)
        text = llm.generate(["hello there"], greedy(2), use_tqdm=False)  # through the tokenizer
    finally:
        llm.close()
    assert len(text[0].token_ids) == 2
    for p, o in zip(prompts, outs):
        want, scores = hf_greedy(ref, p, 6)
        assert_greedy_matches(o.token_ids, want, scores, shape)
