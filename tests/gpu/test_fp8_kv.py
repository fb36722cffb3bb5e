"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) on a CUDA GPU.

Backends: every fast backend and hybrid on an FP8 pool (per-layer scales other than 1.0, so that each backend's
way of applying them is checked) against the torch backend on a byte-for-byte copy of the same pool, for extend and
decode steps, page sizes 1 and 16, and CUDA-graph decode replays. FlashInfer's wrappers read the FP8 pool with q in
bf16 and convert K/V exactly, so they must agree as closely as on a bf16 pool (1e-2). FlashAttention-3's FP8 mode
also rounds q and the softmax probabilities to e4m3 (3 mantissa bits: up to 2^-4 of each value), which on these
random inputs moves the output by about 3.5% (a float64 simulation of those two roundings); its bound is 8e-2. So
does XQA, the decode backend that takes fi's decode steps over an FP8 pool on Hopper (`--fp8-decode-kernel
auto|xqa`, attention/xqa.py): the same bound.

End to end: a random-weight Qwen3-0.6B-shaped checkpoint with an FP8 pool against HF transformers in bf16 (which
keeps K/V in bf16): every generated token is HF's argmax or within 0.25 logit of it, with CUDA graphs and overlap
scheduling on; the pool sized from memory holds twice the tokens of a bf16 one.
"""
from __future__ import annotations

import pytest
import torch

from minisrv import LLM, SamplingParams
from minisrv.attention import create_backend
from minisrv.batch import ForwardMode
from minisrv.attention.xqa import PAGE_SIZES as XQA_PAGE_SIZES

from .common import (CKPT, assert_near_hf_greedy, decode_kernel, free_cuda, mixed_prompts, requires_ckpt,
                     skip_unless_runs, start_decoding, stream_syncs)
from .test_backends import (NUM_LAYERS, TOL, Scene, _rel_err, check_cuda_graph_decode, run_against_torch,
                            same_bytes)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP8 = torch.float8_e4m3fn
FA_FP8_TOL = 8e-2
# per-layer (K, V) scales, NUM_LAYERS of each: not powers of two, so a scale applied twice or not at all shows
SCALES = ([0.75, 1.5], [1.25, 0.625])
# (q heads, kv heads, head_dim, dtype): FlashInfer's tensor-core and CUDA-core decode at head_dim 128, head_dim 64,
# and fp16 (FA3's FP8 mode answers in bf16, which the backend casts back)
CONFIGS = [(32, 8, 128, torch.bfloat16), (16, 8, 128, torch.bfloat16), (16, 2, 64, torch.float16)]
CONFIG_IDS = [f"{hq}-{hkv}-{d}-{'bf16' if dt is torch.bfloat16 else 'fp16'}" for hq, hkv, d, dt in CONFIGS]


def _tol(name: str, mode: ForwardMode, kernel: str = "flashinfer") -> float:
    """The bound of the kernel that runs the step: FA3's FP8 mode and XQA multiply in e4m3."""
    parts = name.split(",")
    used = parts[-1] if mode is ForwardMode.DECODE else parts[0]
    e4m3_products = used == "fa" or (used in ("fi", "triton") and mode is ForwardMode.DECODE and kernel == "xqa")
    return FA_FP8_TOL if e4m3_products else TOL


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kernel", ["auto", "flashinfer", "xqa"])
def test_fi_decode_kernel_choice(kernel, page_size):
    """auto is XQA wherever it can run (Hopper, pages of 16 or more), else the wrappers; XQA asked for where it
    cannot run is a clear error."""
    skip_unless_runs("fi")
    sc = Scene(page_size, torch.bfloat16, 8, 128, kv_dtype=FP8)
    runs = page_size in XQA_PAGE_SIZES and _hopper()
    if kernel == "xqa" and not runs:
        with pytest.raises(ValueError, match="xqa FP8 decode kernel needs"):
            create_backend("fi", sc.pool, sc.table, 16, kernel)
        return
    want = "xqa" if kernel == "xqa" or (kernel == "auto" and runs) else "flashinfer"
    assert decode_kernel(create_backend("fi", sc.pool, sc.table, 16, kernel)) == want
    bf16 = Scene(page_size, torch.bfloat16, 8, 128)
    assert decode_kernel(create_backend("fi", bf16.pool, bf16.table, 16, "auto")) == "flashinfer"


@pytest.mark.parametrize("hq,hkv,d,dtype", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
@pytest.mark.parametrize("name,kernel", [("fa", "flashinfer"), ("fi", "flashinfer"), ("fa,fi", "flashinfer"),
                                         ("fi", "xqa"), ("fa,fi", "xqa"), ("fa,triton", "flashinfer"),
                                         ("fa,triton", "xqa")])
def test_fp8_pool_matches_torch(name, kernel, mode, page_size, dtype, hq, hkv, d):
    """kernel: the fi backend's FP8 decode kernel (xqa: decode steps on Hopper, pages of 16)."""
    if kernel == "xqa" and not (mode is ForwardMode.DECODE and page_size in XQA_PAGE_SIZES and _hopper()):
        pytest.skip("XQA runs decode steps over pages of 16 or more, on Hopper")
    sc, ref_pool, out, ref, t = run_against_torch(name, mode, page_size, dtype, hq, hkv, d, kv_dtype=FP8,
                                                  scales=SCALES, fp8_decode_kernel=kernel)
    tol = _tol(name, mode, kernel)
    for layer in range(NUM_LAYERS):
        assert out[layer].shape == (t, hq, d) and out[layer].dtype == dtype
        err = _rel_err(out[layer], ref[layer])
        print(f"{name} ({kernel}) {mode.value} page {page_size} {hq}-{hkv}-{d}: layer {layer} relative error "
              f"{err:.4f}")
        assert err < tol, f"layer {layer}: relative error {err:.3g} (bound {tol})"
        assert sc.pool.k[layer].dtype == FP8
        assert same_bytes(sc.pool.k[layer], ref_pool.k[layer])
        assert same_bytes(sc.pool.v[layer], ref_pool.v[layer])


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 8, 128)])  # fi: tensor-core and CUDA-core decode
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["fa", "fi", "fa,triton"])
def test_fp8_cuda_graph_decode(name, page_size, hq, hkv, d):
    check_cuda_graph_decode(name, page_size, hq, hkv, d, kv_dtype=FP8, scales=SCALES,
                            tol=_tol(name, ForwardMode.DECODE))


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 8, 128)])
def test_xqa_cuda_graph_decode(hq, hkv, d):
    if not _hopper():
        pytest.skip("XQA's FP8 kernel is Hopper's")
    check_cuda_graph_decode("fi", 16, hq, hkv, d, kv_dtype=FP8, scales=SCALES, tol=FA_FP8_TOL,
                            fp8_decode_kernel="xqa")


# ---------------------------------------------------------------------------------------------------------------
# end to end

# (backend, fp8_decode_kernel): auto is XQA for fi decoding on Hopper
CASES = [("fa", "auto"), ("fi", "auto"), ("fa,fi", "auto"), ("torch", "auto"), ("fi", "flashinfer"),
         ("fa,fi", "flashinfer")]
N_PROMPTS, N_NEW = 16, 32
GAP = 0.25  # logits: a generated token may sit this far below HF's argmax (bf16 K/V there, e4m3 here)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(N_PROMPTS, 5, 300, seed=1)


@requires_ckpt
@pytest.mark.parametrize("backend,kernel", CASES)
def test_greedy_matches_hf_with_fp8_pool(backend, kernel, prompts, hf):
    skip_unless_runs(backend)
    llm = LLM(model=CKPT, attention_backend=backend, dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
              fp8_decode_kernel=kernel, max_total_tokens=65536, cuda_graph_max_bs=64, log_level="warning")
    eng = llm.engine
    used = decode_kernel(eng.runner.backend)
    try:
        assert eng.parts.pool.quantized and eng.overlap
        if backend.endswith("fi"):
            assert used == ("xqa" if kernel == "auto" and _hopper() else "flashinfer")
        assert (eng.runner.graph_runner is not None) == (backend != "torch")
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                            use_tqdm=False)
        if backend != "torch":  # the FP8 store and query casts add no synchronisation to a decode step
            reqs = start_decoding(eng, mixed_prompts(12, 10, 200, seed=5),
                                  SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True))
            syncs = stream_syncs(lambda step=eng.step: [step() for _ in range(8)])
            assert not syncs, "decode steps synchronised the stream at:\n" + "\n".join(syncs)
            for r in reqs:
                eng.abort(r.rid)
            while eng.has_work():
                eng.step()
        assert eng.flush_cache()  # every page back: nothing leaked on the FP8 path
        assert eng.parts.allocator.num_free == eng.num_free_pages_when_idle
    finally:
        del llm, eng
        free_cuda()
    assert_near_hf_greedy(hf, prompts, outs, N_NEW, GAP, f"{backend} with an FP8 pool, decode kernel {used}")


@requires_ckpt
def test_pool_sized_from_memory_holds_twice_the_tokens():
    skip_unless_runs("fi")
    slots = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(model=CKPT, attention_backend="fi", dtype="bfloat16", kv_cache_dtype=kv, disable_cuda_graph=True,
                  log_level="warning")
        try:
            slots[kv] = llm.engine.parts.pool.num_slots
            nbytes = llm.engine.parts.pool.nbytes
        finally:
            del llm
            free_cuda()
        print(f"kv {kv}: {slots[kv]} tokens, {nbytes / 2**30:.2f} GiB")
    ratio = slots["fp8_e4m3"] / slots["auto"]
    assert 1.9 < ratio < 2.1, f"an FP8 pool holds {ratio:.2f}x the tokens of a bf16 one"
