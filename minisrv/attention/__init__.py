"""Registry of attention backends, keyed by the `--attention-backend` strings.

Names: `torch`, `fa`, `fi`, and any hybrid `P,D` (prefill/extend on P, decode on D; `fa,fa` is `fa`); `triton`
(minisrv's own decode kernel, triton_decode.py) decodes only, so it is named as a decode half (`fa,triton`).
A backend's module is imported only when it is chosen, so `import minisrv` needs no GPU library.
`auto` resolves by the GPU's SM version: SM100+ -> fi, SM90 -> fa,fi, other CUDA GPUs -> fi, no CUDA -> torch; if
what auto picked cannot load it falls back (fa,fi -> fa -> fi -> torch, passing over a step that fails for the same
reason) and logs why. `fa,triton` is asked for by name: its decode steps are faster on mixture-of-experts models,
but not by enough end to end to be the default.
Where fi or triton decodes an FP8 pool, `create_backend` gives decode steps to the xqa backend (xqa.py) as
`--fp8-decode-kernel` says: `fi` becomes the hybrid fi + xqa, `fa,fi` and `fa,triton` the hybrid fa + xqa.
Each backend says which of a model's attention features (models/attention_options.py: sliding windows, logit
soft-capping, learned sinks) it serves; one asked for by name that lacks a feature the model has is refused at start,
and auto passes over it. (xqa serves none: such models keep FlashInfer's FP8 decode.) Sinks (gpt-oss) are served by
torch and fa, not fi: FlashInfer's fa2/fa3 wrappers take them only through a JIT variant of the prefill wrapper
(BatchAttentionWithAttentionSinkWrapper), not its decode wrappers nor CUDA-graph ones.
A pool whose windowed layers keep only their window (kvcache/pool.py) is read through a second request->token table:
torch, fa and fi read it (`WINDOW_POOL`); a model served by any other backend keeps one full pool.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Optional, Sequence

import torch

from minisrv.models.attention_options import SINKS, SOFTCAP, WINDOW, LayerAttention

from .base import AttentionBackend, AttentionStep, HybridBackend

if TYPE_CHECKING:
    from minisrv.kvcache import KVPool

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionStep", "HybridBackend", "BACKENDS", "resolve_backend", "create_backend",
           "BackendUnavailable", "serves_window_pool"]


class BackendUnavailable(RuntimeError):
    pass


def _package_present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def device_sm(device: Optional[torch.device] = None) -> Optional[int]:
    """SM version as an int (90 for 9.0), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _needs(who: str, gpu_ok: Callable[[int], bool], which_gpu: str, library: str,
           *modules: str) -> Callable[[Optional[int]], Optional[str]]:
    """What backend `who` lacks on a GPU of SM version `sm` (None: no CUDA), or None: a GPU that `gpu_ok` takes
    (`which_gpu` says which), then any of the Python `modules` (`library` says how to install one)."""
    def missing(sm: Optional[int]) -> Optional[str]:
        if sm is None:
            return f"the {who} needs a CUDA GPU"
        if not gpu_ok(sm):
            return f"the {which_gpu}; this GPU is SM{sm}"
        if not any(_package_present(m) for m in modules):
            return f"the {who} needs {library}"
        return None
    return missing


# name -> (what it lacks on this machine, the module and class that implement it, imported when it is created, the
# attention features it serves)
BACKENDS: Dict[str, tuple] = {
    "torch": (lambda sm: None, "torch_native", "TorchNativeBackend", {WINDOW, SOFTCAP, SINKS}),
    # (FA3 builds may leave tanh soft-capping out, as upstream's FLASHATTENTION_DISABLE_SOFTCAP does: left to fi)
    "fa": (_needs("fa backend", lambda sm: sm // 10 == 9, "fa backend (FlashAttention-3) needs an SM90 (Hopper) GPU",
                  "FlashAttention-3: pip install sgl-kernel (or upstream flash_attn_interface)", "sgl_kernel",
                  "flash_attn_interface"), "fa", "FlashAttentionBackend", {WINDOW, SINKS}),
    "fi": (_needs("fi backend", lambda sm: sm >= 75, "fi backend (FlashInfer) needs SM75 or newer",
                  "FlashInfer: pip install flashinfer-python", "flashinfer"), "fi", "FlashInferBackend",
           {WINDOW, SOFTCAP}),
    "triton": (_needs("triton decode backend", lambda sm: sm >= 80, "triton decode backend needs SM80 or newer",
                      "Triton: pip install triton", "triton"), "triton_decode", "TritonDecodeBackend", set()),
}
DECODE_ONLY = ("triton",)
WINDOW_POOL = ("torch", "fa", "fi")  # the backends that read a pool whose windowed layers keep only their window

AUTO_FALLBACK = {"fa,fi": "fa", "fa": "fi", "fi": "torch"}


def _parts(name: str) -> List[str]:
    parts = [p.strip() for p in name.split(",")]
    if len(parts) not in (1, 2) or any(p not in BACKENDS for p in parts):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, {', '.join(BACKENDS)} "
                         f"or a hybrid PREFILL,DECODE such as fa,fi")
    if parts[0] in DECODE_ONLY:
        raise ValueError(f"attention backend {parts[0]!r} runs decode steps only: name it as the decode half of a "
                         f"hybrid PREFILL,DECODE such as fa,{parts[0]}")
    return parts


def canonical(name: str) -> str:
    parts = _parts(name)
    return parts[0] if len(parts) == 1 or parts[0] == parts[1] else f"{parts[0]},{parts[1]}"


def missing(name: str, sm: Optional[int], features: FrozenSet[str] = frozenset()) -> Optional[str]:
    """Why `name` cannot run here, or cannot serve a model with these attention features; None if it can."""
    for p in dict.fromkeys(_parts(name)):
        why = BACKENDS[p][0](sm)
        if why:
            return why
        lacking = sorted(set(features) - BACKENDS[p][3])
        if lacking:
            return f"the {p} backend does not serve {' nor '.join(lacking)}, which this model has"
    return None


def serves_window_pool(name: str) -> bool:
    """Whether `name` (each half of a hybrid) reads a pool whose windowed layers keep only their window."""
    return all(p in WINDOW_POOL for p in _parts(name))


def auto_choice(sm: Optional[int]) -> str:
    return "torch" if sm is None else "fa,fi" if sm == 90 else "fi"


def resolve_backend(name: str, device: torch.device, features: FrozenSet[str] = frozenset()) -> str:
    """Turn a user's choice into a backend that can run here and serves the model's attention `features`, or raise
    BackendUnavailable saying what is missing."""
    sm = device_sm(device) if device.type == "cuda" else None
    if name == "auto":
        choice = auto_choice(sm)
        while (why := missing(choice, sm, features)) is not None:
            nxt = AUTO_FALLBACK[choice]
            while nxt in AUTO_FALLBACK and missing(nxt, sm, features) == why:  # (fa alone, when fa,fi lacked fa)
                nxt = AUTO_FALLBACK[nxt]
            logger.warning("attention backend auto: %s cannot run (%s); falling back to %s", choice, why, nxt)
            choice = nxt
        logger.info("attention backend auto resolved to %s (SM %s)", choice, sm)
        return choice
    choice = canonical(name)
    why = missing(choice, sm, features)
    if why is not None:
        raise BackendUnavailable(f"attention backend {choice!r} cannot run: {why}")
    return choice


def create_backend(name: str, pool: "KVPool", req_to_token: torch.Tensor, num_q_heads: int,
                   fp8_decode_kernel: str = "auto", layers: Optional[Sequence[LayerAttention]] = None,
                   window_table: Optional[torch.Tensor] = None) -> AttentionBackend:
    """Create a resolved backend (see resolve_backend); a hybrid shares the pool between its two halves.
    fp8_decode_kernel: EngineConfig.fp8_decode_kernel (see the module docstring and xqa.fp8_decode). layers: each
    layer's attention options (None: plain causal attention). window_table: where the pool's windowed layers keep
    only their window (kvcache/pool.py), the request->token table of their slots; only WINDOW_POOL's backends read
    such a pool (xqa, serving no window, never decodes it)."""
    parts = _parts(name)
    if window_table is not None:
        if not serves_window_pool(name):
            raise ValueError(f"the {name} backend reads every layer's K/V through one request->token table")
        halves = [_create(p, pool, req_to_token, num_q_heads, layers, window_table=window_table)
                  for p in dict.fromkeys(parts)]
        return halves[0] if len(halves) == 1 else HybridBackend(*halves)
    prefill = _create(parts[0], pool, req_to_token, num_q_heads, layers)
    decode = None
    if parts[-1] in ("fi", "triton"):
        from .xqa import fp8_decode
        decode = fp8_decode(pool, req_to_token, num_q_heads, fp8_decode_kernel, layers)
    if decode is None:
        if parts[-1] == parts[0]:
            return prefill
        decode = _create(parts[-1], pool, req_to_token, num_q_heads, layers)
    return HybridBackend(prefill, decode)


def _create(name: str, pool: "KVPool", req_to_token: torch.Tensor, num_q_heads: int,
            layers: Optional[Sequence[LayerAttention]], **kwargs) -> AttentionBackend:
    _, module, cls, _ = BACKENDS[name]
    return getattr(importlib.import_module(f".{module}", __name__), cls)(pool, req_to_token, num_q_heads, layers,
                                                                         **kwargs)
