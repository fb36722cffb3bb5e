"""Shared by the GPU tests: the random-weight checkpoint (made by tests/gpu/run.sh) and HF's reference model."""
import gc
import importlib.util
import os
import random
import warnings
from typing import Callable, List

import pytest
import torch

CKPT = os.environ.get("MINISRV_GPU_CKPT", "/tmp/qwen3")

requires_ckpt = pytest.mark.skipif(
    not (torch.cuda.is_available() and os.path.isfile(os.path.join(CKPT, "config.json"))),
    reason="needs CUDA and a checkpoint from make_checkpoint.py at $MINISRV_GPU_CKPT")


TIE = 0.05  # a bf16 near-tie: the top two logprobs this close may legitimately swap between kernels


def helper_module(name: str):
    """tests/helpers/<name>.py loaded by path: the helpers package's __init__ imports the CPU suite's dependencies
    (transformers, gguf), which a GPU machine need not have."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def skip_unless_runs(backend: str) -> None:
    """Skip the test when `backend` cannot run on this GPU (a package missing, or the wrong SM)."""
    from minisrv.attention import device_sm, missing
    why = missing(backend, device_sm())
    if why:
        pytest.skip(why)


def assert_same_up_to_ties(first, second, what: str) -> None:
    """Two runs' outputs (`first` with logprobs of 2 or more) give each prompt the same tokens, or the same up to a
    position where `first`'s top two logprobs are within TIE; after such a tie the continuations may differ."""
    for i, (x, y) in enumerate(zip(first, second)):
        for j, (a, b) in enumerate(zip(x.token_ids, y.token_ids)):
            if a != b:
                top = sorted(x.logprobs[j].top.values(), reverse=True)
                assert top[0] - top[1] < TIE, f"{what}, prompt {i}: token {j} differs ({a} vs {b}) " \
                                              f"without a near-tie ({top})"
                break


def start_decoding(eng, prompts, params) -> list:
    """Add the requests and step the engine until every one has finished its prefill and is decoding."""
    reqs = [eng.add_request(p, params) for p in prompts]
    while any(len(r.output_ids) < 2 for r in reqs):
        eng.step()
    return reqs


def mixed_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 10000):
    rnd = random.Random(seed)
    return [[rnd.randrange(vocab) for _ in range(rnd.randint(lo, hi))] for _ in range(n)]


def free_cuda():
    gc.collect()
    torch.cuda.empty_cache()


def hf_model(dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(CKPT, dtype=dtype).cuda().eval()


def gap_to_hf_argmax(hf, prompt: List[int], token_ids: List[int]) -> float:
    """How far below HF's argmax logit the worst of `token_ids` (generated after `prompt`) is; 0 when every token is
    HF's greedy choice (bf16 near-ties make small gaps legitimate)."""
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt + token_ids], device="cuda")).logits[0].float()
    return gap_below_argmax(ref, len(prompt), token_ids)


def gap_below_argmax(logits: torch.Tensor, prompt_len: int, token_ids: List[int]) -> float:
    """How far below the argmax the worst of `token_ids` is, in `logits` [prompt_len + len(token_ids), vocab] of
    the prompt followed by them (row i predicts position i + 1)."""
    at = logits[prompt_len - 1: prompt_len - 1 + len(token_ids)]
    chosen = at.gather(1, torch.tensor(token_ids, device=at.device)[:, None]).squeeze(1)
    return (at.max(dim=1).values - chosen).max().item()


# bf16 rounding of the tiny random models' hidden states flips near-ties: the same runs on the CPU in bf16 pick a
# token 0.19 (Phi-4-mini shape) and 0.05 (gpt-oss shape) logits below float64 HF's argmax; a fault costs whole
# logits. (A mixture's top-k choice near a tie flips too, and moves that token's logits by whole ones, HF's own bf16
# run's as well: the gpt-oss test's tokens take all their experts.)
BF16_TIE = 0.5


def assert_float64_hf_greedy(path: str, prompts, outs, what: str) -> None:
    """Each generated token is float64 HF's argmax on the checkpoint at `path` (the CPU suite's reference), or
    within BF16_TIE logits of it."""
    from ..helpers import hf_logits
    for p, o in zip(prompts, outs):
        gap = gap_below_argmax(hf_logits(path, p + o.token_ids).float(), len(p), o.token_ids)
        assert gap <= BF16_TIE, f"{what}: a generated token is {gap:.3f} logits below HF's argmax"


def assert_near_hf_greedy(hf, prompts, outs, n_new: int, max_gap: float, what: str) -> float:
    """Every output has n_new tokens and each is HF's argmax or within max_gap logits of it; returns the worst gap."""
    worst = 0.0
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == n_new
        gap = gap_to_hf_argmax(hf, p, o.token_ids)
        worst = max(worst, gap)
        assert gap <= max_gap, f"{what}: a generated token is {gap:.3f} logits below HF's argmax"
    print(f"{what}: worst gap to HF's argmax {worst:.4f}")
    return worst


def stream_syncs(run: Callable[[], None]) -> List[str]:
    """Where run() synchronised the CUDA stream (torch's sync debug mode), as sorted "file:line: message" lines."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    return sorted({f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)})


def decode_kernel(backend) -> str:
    """The kernel that decodes: "xqa" or "flashinfer" for fi, else the decode backend's name."""
    half = getattr(backend, "decode_backend", backend)
    return getattr(half, "decode_kernel", half.name)
