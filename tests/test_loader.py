"""Checkpoint loading: configs read the way transformers writes them (rope_parameters), rotary frequencies against
HF's rope init functions, sharded checkpoints, and clear errors for unknown architectures and broken weights
(truncated file, missing / mis-shaped / unexpected tensor), after which loading a good model still works."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisrv.models.args import ModelArgs
from minisrv.models.layers import rope_inv_freq
from minisrv.checkpoints.loader import WeightLoadError, load_model_args
from minisrv.models.registry import UnsupportedArchitecture

from .helpers.gguf_writer import write_gguf
from .helpers import (ARCHS, LLAMA3_ROPE, assert_greedy_matches, assert_pool_free, build_tiny_model, greedy,
                      hf_greedy, hf_logits, hf_model, make_config, make_llm, make_prompts, rel_err, vocab_of)

SUPPORTED = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


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
    q.pop("layer_types")  # a transformers 4 config
    assert ModelArgs.from_hf_config(q).sliding_window == 1024
    m = MistralConfig(**base, sliding_window=4096).to_dict()
    assert ModelArgs.from_hf_config(m).sliding_window == 4096
    m = MistralConfig(**base, sliding_window=None).to_dict()
    assert ModelArgs.from_hf_config(m).sliding_window is None
    assert ModelArgs.from_hf_config(make_config("llama").to_dict()).sliding_window is None


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
    ours = rope_inv_freq(head_dim, theta, None if scaling is None else {k: v for k, v in params.items()
                                                                      if k != "rope_theta"})
    assert ours.shape == ref.shape
    assert torch.allclose(ours.double(), ref.double(), rtol=1e-6, atol=0)


def test_unsupported_rope_scaling_is_refused(tiny_model, tmp_path):
    path = _copy(tiny_model("llama"), tmp_path)
    _edit_config(path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="yarn.*supported: default, linear, llama3"):
        make_llm(path)


# ---------------------------------------------------------------------------------------------------------------
# checkpoints: sharded, tied head stored, and broken ones


def _copy(src: str, tmp_path, name: str = "m") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: str, **changes) -> None:
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    cfg.update(changes)
    with open(f, "w") as fh:
        json.dump(cfg, fh)


def _rewrite_weights(path: str, edit) -> None:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _still_serves(tiny_model) -> None:
    """After a failed load, a good checkpoint loads and generates what HF generates."""
    path = tiny_model("qwen3")
    llm = make_llm(path)
    prompt = make_prompts(vocab_of(path), [9], seed=21)[0]
    out = llm.generate(prompt, greedy(6), use_tqdm=False)[0]
    ref, scores = hf_greedy(path, prompt, 6)
    assert_greedy_matches(out.token_ids, ref, scores, "after a failed load")
    assert_pool_free(llm.engine)


def test_sharded_checkpoint(tmp_path):
    path = str(tmp_path / "sharded")
    build_tiny_model(path, "qwen3", seed=5)
    # re-save the same weights in several shards with an index
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = str(tmp_path / "sharded2")
    m.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(path, f), sharded)
    files = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert len(files) > 2 and os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    llm = make_llm(sharded)
    prompt = make_prompts(vocab_of(path), [20], seed=22)[0]
    out = llm.generate(prompt, greedy(8, logprobs=1), use_tqdm=False)[0]
    ref, scores = hf_greedy(path, prompt, 8)
    assert_greedy_matches(out.token_ids, ref, scores, "sharded")
    # an index naming a shard that is not there
    os.remove(os.path.join(sharded, sorted(files)[-1]))
    with pytest.raises(WeightLoadError, match="missing"):
        make_llm(sharded)


def test_tied_checkpoint_that_also_stores_lm_head(tiny_model, tmp_path):
    src = tiny_model("qwen2")
    path = _copy(src, tmp_path)
    _rewrite_weights(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    llm = make_llm(path)
    prompt = make_prompts(vocab_of(src), [11], seed=23)[0]
    out = llm.generate(prompt, greedy(6), use_tqdm=False)[0]
    ref, scores = hf_greedy(src, prompt, 6)
    assert_greedy_matches(out.token_ids, ref, scores, "tied with stored lm_head")


def test_unknown_architecture(tiny_model, tmp_path):
    path = _copy(tiny_model("llama"), tmp_path)
    _edit_config(path, architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedArchitecture) as e:
        make_llm(path)
    msg = str(e.value)
    assert "FooForCausalLM" in msg and all(name in msg for name in SUPPORTED)
    assert isinstance(e.value, ValueError)
    _still_serves(tiny_model)


def test_truncated_weight_file(tiny_model, tmp_path):
    path = _copy(tiny_model("llama"), tmp_path)
    f = os.path.join(path, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(WeightLoadError, match="model.safetensors is truncated or damaged"):
        make_llm(path)
    with open(f, "r+b") as fh:  # even the header cut short
        fh.truncate(5)
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        make_llm(path)
    _still_serves(tiny_model)


def test_missing_tensor(tiny_model, tmp_path):
    path = _copy(tiny_model("mistral"), tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        make_llm(path)
    _still_serves(tiny_model)


def test_missing_untied_lm_head(tiny_model, tmp_path):
    path = _copy(tiny_model("llama"), tmp_path)
    _rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensor.*lm_head\.weight"):
        make_llm(path)


def test_misshaped_tensor(tiny_model, tmp_path):
    path = _copy(tiny_model("qwen2"), tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_weights(path, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight.*\(16, 64\).*expected \(32, 64\)"):
        make_llm(path)
    path = _copy(tiny_model("qwen2"), tmp_path, "bias")
    _rewrite_weights(path, lambda t: t.__setitem__("model.layers.1.self_attn.v_proj.bias", torch.zeros(31)))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias"):
        make_llm(path)
    _still_serves(tiny_model)


def test_unexpected_tensor(tiny_model, tmp_path):
    path = _copy(tiny_model("qwen3"), tmp_path)
    _rewrite_weights(path, lambda t: t.__setitem__("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64)))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor 'model\.layers\.7\.mlp\.up_proj\.weight'"):
        make_llm(path)


def test_missing_files(tiny_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_llm(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_llm(str(empty))
    path = _copy(tiny_model("llama"), tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(WeightLoadError, match="no .*safetensors"):
        make_llm(path)


def test_float32_logits_of_a_loaded_checkpoint_match_hf_float32(tiny_model):
    """The same forward against HF run in float32 too (not only float64)."""
    path = tiny_model("llama")
    eng = make_llm(path).engine
    prompt = make_prompts(vocab_of(path), [33], seed=24)[0]
    from transformers import AutoModelForCausalLM
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref32 = hf32(torch.tensor([prompt])).logits[0, -1]
    req = eng.add_request(prompt, greedy(1))
    batch = eng.scheduler.schedule()
    logits = eng.runner.forward_logits(eng.runner.build_forward_batch(batch))[0]
    eng.abort(req.rid)
    assert rel_err(logits, ref32) < 1e-4
    assert rel_err(logits, hf_logits(path, prompt)[-1]) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# GGUF: a tiny checkpoint written the way llama.cpp's converter writes one (float32 tensors, llama.cpp names, Llama
# q/k rows permuted for its rotary), loaded through the GGUF path and compared with HF on the original weights

@pytest.mark.parametrize("name,arch,overrides", [
    ("llama", "llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            max_position_embeddings=256)),
    ("qwen2", "qwen2", dict()),  # tied (no output.weight), qkv biases, not permuted
])
def test_gguf_checkpoint_matches_hf(tmp_path, name, arch, overrides):
    hf_dir = build_tiny_model(str(tmp_path / "hf"), name, seed=9, **overrides)
    gguf_file = str(tmp_path / "tiny.gguf")
    write_gguf(hf_dir, gguf_file, arch)
    llm = make_llm(gguf_file, tokenizer=hf_dir)
    args = llm.engine.args
    ref_args = load_model_args(hf_dir)
    assert args.tie_word_embeddings == ref_args.tie_word_embeddings
    assert args.attention_bias == ref_args.attention_bias and args.rope_theta == ref_args.rope_theta
    prompts = make_prompts(vocab_of(hf_dir), [20, 45], seed=25)
    outs = llm.generate(prompts, greedy(10), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, scores = hf_greedy(hf_dir, p, 10)
        assert_greedy_matches(o.token_ids, ref, scores, f"{name} GGUF")
    eng = llm.engine
    req = eng.add_request(prompts[1], greedy(1))
    logits = eng.runner.forward_logits(eng.runner.build_forward_batch(eng.scheduler.schedule()))[0]
    eng.abort(req.rid)
    assert rel_err(logits, hf_logits(hf_dir, prompts[1])[-1]) < 1e-4
    assert_pool_free(eng)


# ---------------------------------------------------------------------------------------------------------------
# truncated or damaged files: the error names the file and the damage (for a cut in the tensor data: the tensor,
# its absolute byte range and the file's size) before gguf / safetensors / transformers fail on the short file


def _load(path: str, args: ModelArgs):
    from minisrv.checkpoints.loader import load_model
    return load_model(path, args, torch.float32, torch.device("cpu"), 64)


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
    path = _copy(tiny_model("llama"), tmp_path)
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
    path = _copy(tiny_model("mistral"), tmp_path)
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
    _still_serves(tiny_model)


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
