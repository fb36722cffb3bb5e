"""The paged KV pool: a slot is one token's place, slot = page * page_size + offset.

The pool holds K and V either in the model's dtype or in float8_e4m3fn (`--kv-cache-dtype fp8_e4m3`), which fits
twice as many tokens as bf16 in the same memory. An FP8 pool stores K / k_scale and V / v_scale, saturated to e4m3's
finite range (+-448, so an outlier is clipped rather than turned into NaN), with one K scale and one V scale per
layer; whoever reads multiplies back. The scales are 1.0 unless a checkpoint's calibrated ones are given to
`set_scales` (which must happen before CUDA graphs are captured: FlashInfer bakes them into its launch arguments).

On the CPU the pool is anonymous memory mapped from the operating system, which hands it out zeroed and takes
physical pages only as they are first written: a large pool costs nothing at start-up and holds, resident, only the
pages requests have used (the page allocator hands out low pages first).

A model whose sliding-window layers keep only their window (`window_layers`) holds those layers' K/V in pages of
their own: `window_pages` of them, fewer than the full layers' pages, with slots of their own that a second
request->token table maps (req_table.py). Which of a sequence's windowed pages are still read is window.py's rule.
"""
from __future__ import annotations

import math
import mmap
from typing import FrozenSet, Sequence, Tuple

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn,)


class KVPool:
    """Per layer, K and V of shape [num_pages, page_size, num_kv_heads, head_dim]: the two halves of one
    [2, num_pages, page_size, num_kv_heads, head_dim] tensor, so a step's new K and V can be stored with one
    kernel when they sit side by side in memory (as they do in a fused qkv projection's output).

    `dtype` is what the model computes K/V in; `kv_dtype` is what the pool holds. Scales live twice: `kv_scale`
    [num_layers, 2] (K, V) float32 on the device, for kernels, which take tensors; `k_scale_host` / `v_scale_host`
    as Python floats, for FlashInfer, which folds them into its softmax scale on the host (`set_scales` writes both).
    A layer of `window_layers` has `window_pages` pages instead of `num_pages`; a layer's slots are its kind's.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None,
                 window_layers: FrozenSet[int] = frozenset(), window_pages: int = 0) -> None:
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype != dtype and kv_dtype not in FP8_KV_DTYPES:
            raise ValueError(f"a KV pool holds the model's dtype or {FP8_KV_DTYPES}, not {kv_dtype}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.device = device
        self.window_layers = frozenset(window_layers)
        self.window_pages = window_pages
        self.kv = [_zeros((2, window_pages if i in self.window_layers else num_pages, page_size, num_kv_heads,
                           head_dim), kv_dtype, device) for i in range(num_layers)]
        self.k = [kv[0] for kv in self.kv]
        self.v = [kv[1] for kv in self.kv]
        self.kv_scale = torch.ones((num_layers, 2), dtype=torch.float32, device=device)
        self.k_scale_host = [1.0] * num_layers
        self.v_scale_host = [1.0] * num_layers

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in FP8_KV_DTYPES

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * kv_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(kv.numel() for kv in self.kv) * self.kv_dtype.itemsize

    def set_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """A checkpoint's calibrated per-layer K and V scales; before anything is stored or captured."""
        k, v = [float(s) for s in k_scales], [float(s) for s in v_scales]
        if len(k) != self.num_layers or len(v) != self.num_layers:
            raise ValueError(f"need {self.num_layers} K and V scales, got {len(k)} and {len(v)}")
        if not all(0.0 < s < float("inf") for s in k + v):
            raise ValueError("KV scales must be positive and finite")
        if not self.quantized and any(s != 1.0 for s in k + v):
            raise ValueError("KV scales other than 1.0 need an FP8 pool")
        self.k_scale_host, self.v_scale_host = k, v
        self.kv_scale.copy_(torch.tensor([k, v], dtype=torch.float32).t())

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x / scale, saturated to the FP8 type's finite range, as its raw bytes (indexed writes of uint8 work on
        every device and torch version; those of float8 types do not everywhere)."""
        top = torch.finfo(self.kv_dtype).max
        # out of place: x may be a view of the step's qkv output, which must not change
        return (x.float() / scale).clamp_(-top, top).to(self.kv_dtype).view(torch.uint8)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [T, Hkv, D] (the model's dtype) of one layer at slots loc [T]."""
        h, d = self.num_kv_heads, self.head_dim
        kv = self.kv[layer_id].view(2, -1, h, d)
        if self.quantized:
            kv = kv.view(torch.uint8)
        row = h * d
        if (k.shape == v.shape == (k.shape[0], h, d) and k.stride() == v.stride() and k.stride()[1:] == (d, 1)
                and v.data_ptr() - k.data_ptr() == row * k.element_size()):
            # v follows k in every token's row (a fused qkv output): view both as [2, T, H, D], one scatter
            both = k.as_strided((2, k.shape[0], h, d), (row, k.stride(0), d, 1))
            if self.quantized:
                both = self._quantize(both, self.kv_scale[layer_id].view(2, 1, 1, 1))
            kv[:, loc] = both
            return
        if self.quantized:
            k = self._quantize(k, self.kv_scale[layer_id, 0])
            v = self._quantize(v, self.kv_scale[layer_id, 1])
        kv[0][loc] = k
        kv[1][loc] = v

    def load(self, layer_id: int, slots: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape S) in the model's dtype, [*S, Hkv, D] each: an FP8 pool's bytes times
        the layer's scales (skipped where a scale is exactly 1.0, the usual case)."""
        k, v = self.flat_k(layer_id), self.flat_v(layer_id)
        if not self.quantized:
            return k[slots], v[slots]
        k, v = (x.view(torch.uint8)[slots].view(self.kv_dtype).to(self.dtype) for x in (k, v))
        if self.k_scale_host[layer_id] != 1.0:
            k = k * self.kv_scale[layer_id, 0]
        if self.v_scale_host[layer_id] != 1.0:
            v = v * self.kv_scale[layer_id, 1]
        return k, v

    def flat_k(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id].view(-1, self.num_kv_heads, self.head_dim)

    def flat_v(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id].view(-1, self.num_kv_heads, self.head_dim)


def _zeros(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, except on the CPU: zero pages from the operating system, made resident only when written."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
