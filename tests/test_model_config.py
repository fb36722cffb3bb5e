"""Model configs read the way transformers writes them (rope_parameters, legacy keys, sliding windows), and the
rotary frequencies against HF's rope init functions."""
from __future__ import annotations

import json
import os

import pytest
import torch

from minisrv.models.args import ModelArgs
from minisrv.models.layers import rope_inv_freq
from minisrv.checkpoints.loader import load_model_args

from .helpers import ARCHS, LLAMA3_ROPE, hf_model, make_config


@pytest.mark.parametrize("arch", ARCHS)
def test_config_json_round_trip(tiny_model, arch):
    """What ModelArgs reads from the saved config.json agrees with the model HF builds from the same file."""
    path = tiny_model(arch)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    args = load_model_args(path)
    hf = hf_model(path)
    cfg = hf.config
    names = dict(hf.named_parameters())
    assert args.architecture == type(hf).__name__
    assert args.vocab_size == cfg.vocab_size and args.hidden_size == cfg.hidden_size
    assert args.intermediate_size == cfg.intermediate_size
    assert args.num_layers == cfg.num_hidden_layers == len(hf.model.layers)
    assert (args.num_heads, args.num_kv_heads, args.head_dim) == (cfg.num_attention_heads,
                                                                  cfg.num_key_value_heads, cfg.head_dim)
    assert args.rms_norm_eps == cfg.rms_norm_eps
    assert args.max_position_embeddings == cfg.max_position_embeddings
    assert args.rope_theta == cfg.rope_parameters["rope_theta"]
    assert args.tie_word_embeddings == cfg.tie_word_embeddings
    assert args.attention_bias == ("model.layers.0.self_attn.q_proj.bias" in names)
    assert args.qk_norm == ("model.layers.0.self_attn.q_norm.weight" in names)
    assert args.eos_token_ids == [2] and args.bos_token_id == 1
    kind = cfg.rope_parameters.get("rope_type", "default")
    if kind == "default":
        assert args.rope_scaling is None
    else:
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            assert args.rope_scaling[k] == cfg.rope_parameters[k]
        assert args.rope_scaling.get("rope_type") == kind
    # transformers 5 writes rope settings under rope_parameters
    assert "rope_parameters" in raw


def test_expected_tiny_features(tiny_model):
    """The tiny checkpoints cover what they are meant to: llama3 scaling, qkv bias, q/k norm, tied and untied."""
    a = {name: load_model_args(tiny_model(name)) for name in ARCHS}
    assert a["llama"].rope_scaling["rope_type"] == "llama3" and not a["llama"].tie_word_embeddings
    assert a["qwen2"].attention_bias and a["qwen2"].tie_word_embeddings and a["qwen2"].rope_theta == 1e6
    assert a["qwen3"].qk_norm and a["qwen3"].tie_word_embeddings
    assert not a["mistral"].tie_word_embeddings


def test_legacy_rope_scaling_key():
    """Configs written by transformers 4 keep rope_theta at the top and scaling under rope_scaling."""
    cfg = make_config("llama").to_dict()
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    cfg["architectures"] = ["LlamaForCausalLM"]
    args = ModelArgs.from_hf_config(cfg)
    assert args.rope_theta == 500000.0 and args.rope_scaling["factor"] == 8.0
    cfg["rope_scaling"] = {"type": "default"}
    assert ModelArgs.from_hf_config(cfg).rope_scaling is None


def test_sliding_window_read_only_where_it_applies():
    from transformers import MistralConfig, Qwen2Config
    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=4)
    q = Qwen2Config(**base).to_dict()  # sliding window present in the config but off
    q["sliding_window"] = 4096
    assert ModelArgs.from_hf_config(q).sliding_window is None
    q = Qwen2Config(**base, use_sliding_window=True, sliding_window=1024, max_window_layers=2).to_dict()
    assert "sliding_attention" in q["layer_types"] and ModelArgs.from_hf_config(q).sliding_window == 1024
    assert ModelArgs.from_hf_config(q).sliding_layers == (2, 3)
    q.pop("layer_types")  # a transformers 4 config: layers from max_window_layers on, as transformers reads it
    assert ModelArgs.from_hf_config(q).sliding_window == 1024 and ModelArgs.from_hf_config(q).sliding_layers == (2, 3)
    m = MistralConfig(**base, sliding_window=4096).to_dict()
    assert ModelArgs.from_hf_config(m).sliding_window == 4096
    assert ModelArgs.from_hf_config(m).sliding_layers == (0, 1, 2, 3)
    m = MistralConfig(**base, sliding_window=None).to_dict()
    assert ModelArgs.from_hf_config(m).sliding_window is None
    assert ModelArgs.from_hf_config(make_config("llama").to_dict()).sliding_window is None


def test_gemma_configs_as_the_hub_publishes_them():
    """Gemma 3 4B-27B's config.json (transformers 4.50): a Gemma3ForConditionalGeneration whose text_config leaves
    most keys to Gemma3TextConfig's defaults, the window pattern as sliding_window_pattern, the two rope bases as
    rope_theta and rope_local_base_freq; Gemma 2's without layer_types (every other layer windowed)."""
    from transformers import Gemma2Config, Gemma3TextConfig
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
           "torch_dtype": "bfloat16", "vision_config": {"hidden_size": 1152},
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}}
    args = ModelArgs.from_hf_config(hub)
    ref = Gemma3TextConfig(**hub["text_config"])  # what transformers makes of it
    assert (args.vocab_size, args.num_heads, args.num_kv_heads, args.head_dim) == \
        (ref.vocab_size, ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert args.sliding_layers == tuple(i for i, t in enumerate(ref.layer_types) if t == "sliding_attention")
    assert len(args.sliding_layers) == 29 and args.sliding_window == 1024
    assert args.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert args.local_rope_theta == ref.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert args.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert args.query_pre_attn_scalar == 256 and args.eos_token_ids == [1, 106] and args.torch_dtype == "bfloat16"
    assert args.tie_word_embeddings and args.qk_norm and args.gemma_norms and args.hidden_act == "gelu_tanh"
    g2 = Gemma2Config(num_hidden_layers=5, sliding_window=4096).to_dict()
    g2.pop("layer_types")
    g2["architectures"] = ["Gemma2ForCausalLM"]
    args = ModelArgs.from_hf_config(g2)
    assert args.sliding_layers == (0, 2, 4) and args.attn_logit_softcap == 50.0 and args.final_logit_softcap == 30.0
    assert args.local_rope_theta is None


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    dict(LLAMA3_ROPE),
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
@pytest.mark.parametrize("theta,head_dim", [(10000.0, 16), (500000.0, 128)])
def test_rope_frequencies_match_hf(scaling, theta, head_dim):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=131072, rope_parameters=params)
    if scaling is None:
        ref = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, torch.device("cpu"))
    ours, scale = rope_inv_freq(head_dim, theta, None if scaling is None else {k: v for k, v in params.items()
                                                                             if k != "rope_theta"}, 4096)
    assert ours.shape == ref.shape and scale == 1.0
    assert torch.allclose(ours.double(), ref.double(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("context", [32, 33, 256])  # the short factors up to the original 32 positions
@pytest.mark.parametrize("overrides", [{}, {"factor": 4.0}, {"attention_factor": 1.5}])
def test_longrope_frequencies_and_attention_factor_match_hf(context, overrides):
    """Phi-3's LongRoPE over 0.75 of each head: transformers' inverse frequencies for a sequence of `context`
    positions and its attention factor (given, from `factor`, or from max / original positions)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = make_config("phi4_mini")
    cfg.rope_parameters.update(overrides)
    ref, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=context)
    args = ModelArgs.from_hf_config(cfg.to_dict())
    ours, scale = rope_inv_freq(args.rotary_dim, args.rope_theta, args.rope_scaling, context)
    assert torch.equal(ours, ref) and scale == pytest.approx(ref_scale, rel=1e-12)
