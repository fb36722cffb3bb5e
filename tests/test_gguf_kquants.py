"""GGUF Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors kept in the CPU kernels' records (models/gguf_repack.py), each part
against an independent reference: repacked random blocks against a float64 reading written from ggml's definition
(tests/helpers/kquant_blocks.py), bit for bit, and against gguf's own dequantiser; a tiny Llama written as a
Q4_K_M-style mix held in records (no float32 copy of a matrix), its greedy tokens and logprobs against HF
transformers in float64 over the same dequantised weights, its decode layers in one C call against the same layers
run one by one."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from minisrv.models.block_layers import BlockLinear
from minisrv.models.gguf_blocks import GGUFBlocks

from .helpers import assert_greedy_matches, hf_greedy, hf_logits
from .helpers.gguf_reference import write_dequantised_hf
from .helpers.gguf_writer import write_gguf
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
    shutil.copytree(hf, ref)  # its config and tokenizer; the weights are the GGUF's
    write_dequantised_hf(gguf, ref)
    return hf, gguf, ref


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
