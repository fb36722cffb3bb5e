"""Truncated or damaged checkpoint files: the error names the file and the damage (for a cut in the tensor data: the
tensor, its absolute byte range and the file's size) before gguf / safetensors / transformers fail on the short
file."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from minisrv.models.args import ModelArgs
from minisrv.checkpoints.loader import WeightLoadError, load_model_args

from .helpers.checkpoint_edits import copy_model, still_serves
from .helpers.gguf_writer import write_gguf
from .helpers import make_llm


def _load(path: str, args: ModelArgs):
    from minisrv.checkpoints.loader import ModelBuild, load_model
    return load_model(path, ModelBuild(args, torch.float32, torch.device("cpu"), 64)).model


def _cut(src: str, dst: str, size: int) -> str:
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as fh:
        fh.truncate(size)
    return dst


def _patch(src: str, dst: str, at: int, data: bytes) -> str:
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as fh:
        fh.seek(at)
        fh.write(data)
    return dst


def _first_cut_tensor(spans, size: int):
    """(name, first byte, end byte) of the first tensor in file order whose bytes are not all in `size` bytes."""
    return next(s for s in sorted(spans, key=lambda s: (s[1], s[2])) if s[2] > size)


def _raises_load_error(fn, *args, **kwargs) -> str:
    with pytest.raises(WeightLoadError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def _end(field) -> int:
    """Where a gguf reader field (a metadata entry or a tensor info) ends in the file."""
    return field.offset + sum(int(p.nbytes) for p in field.parts)


def _tiny_gguf(tiny_model, tmp_path):
    """A tiny float32 GGUF (Qwen2: tied, qkv biases) and its table as gguf's reader sees it on the intact file."""
    from gguf import GGUFReader
    hf_dir = tiny_model("qwen2")
    good = str(tmp_path / "good.gguf")
    write_gguf(hf_dir, good, "qwen2")
    return hf_dir, good, GGUFReader(good)


def test_truncated_gguf_names_tensor_and_bytes(tiny_model, tmp_path):
    from minisrv.checkpoints.loader import load_hf_config
    hf_dir, good, reader = _tiny_gguf(tiny_model, tmp_path)
    size = os.path.getsize(good)
    spans = [(t.name, int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in reader.tensors]
    assert max(end for _, _, end in spans) == size
    args = load_model_args(good)
    mid = sorted(spans, key=lambda s: s[1])[len(spans) // 2]
    info_end = max(_end(t.field) for t in reader.tensors)
    cuts = {reader.data_offset, mid[1] + (mid[2] - mid[1]) // 2, mid[2], size - 1}
    if info_end < reader.data_offset:  # in the alignment padding before the tensor data
        cuts.add(info_end + (reader.data_offset - info_end) // 2)
    for i, cut in enumerate(sorted(cuts)):
        path = _cut(good, str(tmp_path / f"cut{i}.gguf"), cut)
        name, a, b = _first_cut_tensor(spans, cut)
        want = f"{path} is truncated or damaged: tensor {name} needs bytes {a}..{b}, the file has {cut}"
        assert _raises_load_error(load_model_args, path) == want  # the config is read first: it fails there
        assert _raises_load_error(load_hf_config, path) == want
        assert _raises_load_error(_load, path, args) == want  # and the weights on their own
    assert _raises_load_error(make_llm, path, tokenizer=hf_dir) == want
    # a damaged tensor table: one tensor's offset pointing past the end of an intact-length file
    t = reader.tensors[3]
    at = t.field.offset + sum(int(p.nbytes) for p in t.field.parts[:5])
    rel = int(t.data_offset) - reader.data_offset + 4096 * 1024
    path = _patch(good, str(tmp_path / "offset.gguf"), at, rel.to_bytes(8, "little"))
    a = reader.data_offset + rel
    b = a + int(t.n_bytes)
    want = f"{path} is truncated or damaged: tensor {t.name} needs bytes {a}..{b}, the file has {size}"
    assert _raises_load_error(load_model_args, path) == want
    assert _raises_load_error(_load, path, args) == want
    # the intact file still loads, with the weights it holds
    model = _load(good, load_model_args(good))
    ref = load_file(os.path.join(hf_dir, "model.safetensors"))
    params = dict(model.named_parameters())
    for n in ("model.norm.weight", "model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight"):
        assert torch.equal(params[n].detach(), ref[n]), n


def test_truncated_gguf_header_and_tensor_table(tiny_model, tmp_path):
    hf_dir, good, reader = _tiny_gguf(tiny_model, tmp_path)
    args = load_model_args(good)
    kvs = [f for name, f in reader.fields.items() if not name.startswith("GGUF.")]
    last_kv = kvs[-1]
    cuts = {
        0: "", 2: "", 10: "", 20: "",  # inside the magic, the version, the counts
        kvs[0].offset + 3: "metadata",  # inside the first key
        _end(last_kv) - 1: "metadata",  # the last value's last byte
        reader.tensors[0].field.offset + 2: "tensor info",
        _end(reader.tensors[-1].field) - 1: "tensor info",  # the last tensor info's last byte
    }
    for i, (cut, where) in enumerate(sorted(cuts.items())):
        path = _cut(good, str(tmp_path / f"head{i}.gguf"), cut)
        for fn, fn_args in ((load_model_args, (path,)), (_load, (path, args))):
            msg = _raises_load_error(fn, *fn_args)
            assert msg.startswith(f"{path} is truncated or damaged: cannot read its GGUF header/tensor table ("), msg
            assert msg.endswith(")") and where in msg, msg
    assert "truncated or damaged" in _raises_load_error(make_llm, path, tokenizer=hf_dir)
    path = _patch(good, str(tmp_path / "magic.gguf"), 0, b"GGUX")  # not truncated, damaged
    msg = _raises_load_error(load_model_args, path)
    assert msg.startswith(f"{path} is truncated or damaged: cannot read its GGUF header/tensor table (") and \
        "GGUX" in msg, msg
    assert load_model_args(good).tie_word_embeddings  # the intact file still reads


def _safetensors_table(file: str):
    """The safetensors layout read by hand: (header length, [(name, first byte, end byte)] at file offsets)."""
    import struct
    with open(file, "rb") as fh:
        (hlen,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(hlen))
    return hlen, [(n, 8 + hlen + v["data_offsets"][0], 8 + hlen + v["data_offsets"][1])
                  for n, v in header.items() if n != "__metadata__"]


def test_truncated_safetensors_names_tensor_and_bytes(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path)
    f = os.path.join(path, "model.safetensors")
    good = str(tmp_path / "good.safetensors")
    shutil.copyfile(f, good)
    size = os.path.getsize(good)
    hlen, spans = _safetensors_table(good)
    assert max(end for _, _, end in spans) == size
    args = load_model_args(path)
    mid = sorted(spans, key=lambda s: s[1])[len(spans) // 2]
    for cut in sorted({8 + hlen, mid[1] + (mid[2] - mid[1]) // 2, mid[2], size // 2, size - 1}):
        _cut(good, f, cut)
        name, a, b = _first_cut_tensor(spans, cut)
        want = f"{f} is truncated or damaged: tensor {name} needs bytes {a}..{b}, the file has {cut}"
        assert _raises_load_error(_load, path, args) == want
    assert _raises_load_error(make_llm, path) == want
    shutil.copyfile(good, f)  # the intact file loads again, with its weights
    params = dict(_load(path, args).named_parameters())
    ref = load_file(good)
    for n in ("model.norm.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(params[n].detach(), ref[n]), n


def test_damaged_safetensors_header(tiny_model, tmp_path):
    path = copy_model(tiny_model("mistral"), tmp_path)
    f = os.path.join(path, "model.safetensors")
    good = str(tmp_path / "good.safetensors")
    shutil.copyfile(f, good)
    size = os.path.getsize(good)
    hlen, _ = _safetensors_table(good)
    args = load_model_args(path)
    damage = [
        lambda: _cut(good, f, 0),
        lambda: _cut(good, f, 5),  # inside the header length
        lambda: _cut(good, f, 8 + hlen // 2),  # inside the JSON header
        lambda: _patch(good, f, 0, (2 * size).to_bytes(8, "little")),  # a header length past the end
        lambda: _patch(good, f, 8, b"#"),  # bad JSON, same size
        lambda: _patch(good, f, 8, b"[" + b" " * (hlen - 2) + b"]"),  # JSON, but not an object
    ]
    for make in damage:
        make()
        msg = _raises_load_error(_load, path, args)
        assert msg.startswith(f"{f} is truncated or damaged: cannot read its safetensors header (") and \
            msg.endswith(")"), msg
    assert "truncated or damaged" in _raises_load_error(make_llm, path)
    shutil.copyfile(good, f)
    still_serves(tiny_model)


def _gguf_with_arrays(out: str) -> None:
    """A GGUF whose metadata holds what a real model's does around its tensor table: arrays of strings (a
    vocabulary), of integers, of arrays, and scalars after them; tensors in float32, float16 and Q8_0 blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    rng = np.random.default_rng(3)
    w = GGUFWriter(out, "llama")
    w.add_token_list([f"tok{i}" * (1 + i % 5) for i in range(300)])
    w.add_token_types([i % 6 for i in range(300)])
    w.add_array("test.nested", [[1, 2, 3], [4], ["x", "yz"]])
    w.add_uint32("test.after_arrays", 1234567)
    w.add_string("test.last", "the end")
    w.add_tensor("a.weight", rng.standard_normal((7, 5)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((3, 64)).astype(np.float16))
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_table_matches_gguf_reader(tmp_path):
    """The checked read of a GGUF gives the tensor table gguf's own GGUFReader gives (names, types, shapes, byte
    spans, data) and the scalars written after the metadata arrays whose values it skips."""
    import numpy as np
    from gguf import GGUFReader
    from minisrv.checkpoints.gguf_file import read_gguf
    path = str(tmp_path / "arrays.gguf")
    _gguf_with_arrays(path)
    ref, ours = GGUFReader(path), read_gguf(path)
    assert ours.data_offset == ref.data_offset and len(ours.tensors) == len(ref.tensors) == 3
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.data_offset, a.n_bytes) == \
            (b.name, b.tensor_type, b.shape.tolist(), b.data_offset, b.n_bytes)
        assert np.array_equal(a.data, b.data), a.name
    assert list(ours.fields) == list(ref.fields)
    for key in ("test.after_arrays", "test.last", "general.architecture"):
        assert ours.fields[key].contents() == ref.fields[key].contents(), key
    assert ours.fields["test.after_arrays"].contents() == 1234567


def test_damaged_gguf_array_length_is_a_clear_error(tmp_path):
    """A metadata array whose stored length is garbage fails at once, naming the entry (gguf's own reader walks
    2**60 elements of a short array)."""
    import time
    from gguf import GGUFReader
    from minisrv.checkpoints.gguf_file import read_gguf
    good = str(tmp_path / "arrays.gguf")
    _gguf_with_arrays(good)
    fields = GGUFReader(good).fields
    keys = [k for k in fields if not k.startswith("GGUF.")]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "test.nested"):
        field = fields[key]
        count_at = field.offset + sum(int(p.nbytes) for p in field.parts[:4])  # key length, key, type, item type
        path = _patch(good, str(tmp_path / "count.gguf"), count_at, (2 ** 60).to_bytes(8, "little"))
        start = time.monotonic()
        msg = _raises_load_error(read_gguf, path)
        assert time.monotonic() - start < 10
        entry = f"metadata entry {keys.index(key) + 1} of {len(keys)}"
        assert msg.startswith(f"{path} is truncated or damaged: cannot read its GGUF header/tensor table (") and \
            entry in msg, msg
        if key != "test.nested":  # (whose walk may first meet the bytes of the next entry as an element type)
            assert msg.endswith(f"(the file ends at byte {os.path.getsize(good)}, inside {entry})"), msg
