"""Decode over an FP8 pool on Hopper with XQA, TensorRT-LLM's decode kernel as FlashInfer ships it.

Why: over FP8 pages FlashInfer's decode wrappers and FA3's FP8 mode reach about half the HBM bandwidth, XQA most of
it (docs/kernels.md has the figures). Like FA3's FP8 mode it multiplies in e4m3, rounding q and the softmax
probabilities to e4m3; `--fp8-decode-kernel flashinfer` keeps the exact wrappers.

The kernel takes FA3's description of the batch: a page table [B, max_pages] int32 and the sequence lengths (uint32,
counting the step's own token, whose K/V the backend has stored before it runs). Everything it needs is a tensor or
a constant, so it is captured in CUDA graphs as is, over the full-width static page table. K's scale is folded into
q's (`bmm1_scale`), V's multiplies the output (`bmm2_scale`).

The registry makes it the decode half where fi or triton would decode an FP8 pool (`fp8_decode`), wherever it can
run (`XQADecodeBackend.usable`) under `--fp8-decode-kernel auto`; `xqa` makes a machine where it cannot run an
error. `XQADecodeBackend.load` compiles and runs it once at start-up, so a failure shows there, not in a step.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from minisrv.models.attention_options import LayerAttention, features_of

from .base import AttentionBackend
from .page_table import DecodePages, PageTableGraphs

if TYPE_CHECKING:
    from minisrv.kvcache import KVPool

logger = logging.getLogger(__name__)

PAGE_SIZES = (16, 32, 64, 128)
SEMAPHORE_BYTES = 8 << 20  # the kernel's layout: semaphores first (zero before first use), then scratch
SCRATCH_BYTES = 8 << 20  # partial results of sequences split across CTAs (a few hundred KB at most on an H100)


class XQADecodeBackend(PageTableGraphs, AttentionBackend):
    name = "xqa"
    supports_cuda_graph = True

    def __init__(self, pool: "KVPool", req_to_token: torch.Tensor, num_q_heads: int, layers=None) -> None:
        super().__init__(pool, req_to_token, num_q_heads, layers)
        from flashinfer.decode import xqa_batch_decode_with_kv_cache
        self.kernel = xqa_batch_decode_with_kv_cache
        self.workspace = torch.zeros(SEMAPHORE_BYTES + SCRATCH_BYTES, dtype=torch.uint8, device=self.device)

    @staticmethod
    def usable(pool: "KVPool", device: torch.device) -> bool:
        if pool.kv_dtype != torch.float8_e4m3fn or device.type != "cuda" or pool.page_size not in PAGE_SIZES \
                or torch.cuda.get_device_capability(device)[0] != 9 or not hasattr(torch, "uint32"):
            return False
        try:
            import flashinfer.decode
        except ImportError:
            return False
        return hasattr(flashinfer.decode, "xqa_batch_decode_with_kv_cache")

    def load(self) -> None:
        """Compile (FlashInfer's JIT, cached on disk) and run the kernel once on a one-token batch; raises if it
        cannot."""
        q = torch.zeros((1, self.num_q_heads, self.head_dim), dtype=self.pool.dtype, device=self.device)
        table = torch.zeros((1, 1), dtype=torch.int32, device=self.device)
        self.attend(q, 0, DecodePages(table, table, torch.ones((1,), dtype=torch.int32, device=self.device)))
        torch.cuda.synchronize(self.device)

    def attend(self, q: torch.Tensor, layer_id: int, meta: DecodePages) -> torch.Tensor:
        pool = self.pool
        # the kernel reads q (and writes its output, made like q) as contiguous [B, Hq, D]; the model's q is a
        # strided view of the fused qkv projection. Its lengths are uint32 (a view of the int32 ones).
        return self.kernel(q.contiguous(), (pool.k[layer_id], pool.v[layer_id]), self.workspace, meta.page_table,
                           meta.seq_lens.view(torch.uint32), meta.page_table.shape[1] * self.page_size,
                           bmm1_scale=self.layers[layer_id].scale * pool.k_scale_host[layer_id],
                           bmm2_scale=pool.v_scale_host[layer_id], kv_layout="NHD")


def fp8_decode(pool: "KVPool", req_to_token: torch.Tensor, num_q_heads: int, choice: str,
               layers: Optional[Sequence[LayerAttention]] = None) -> Optional[XQADecodeBackend]:
    """The decode backend for fi decoding over `pool` under `--fp8-decode-kernel choice`: XQA for "xqa" (raises if
    it cannot run here) and for "auto" where it can run; None (FlashInfer's wrappers) otherwise. XQA serves neither
    sliding windows nor soft-capping."""
    if choice == "flashinfer" or not pool.quantized:
        return None
    lacking = features_of(layers or ())
    if lacking or not XQADecodeBackend.usable(pool, req_to_token.device):
        if choice == "xqa":
            raise ValueError(f"the xqa FP8 decode kernel does not serve {' nor '.join(sorted(lacking))}, which this "
                             f"model has: use --fp8-decode-kernel flashinfer" if lacking else
                             "the xqa FP8 decode kernel needs an SM 9.x GPU, an FP8 e4m3 KV cache, pages of "
                             f"{'/'.join(map(str, PAGE_SIZES))} tokens and FlashInfer's XQA; here the page "
                             f"size is {pool.page_size}")
        return None
    try:
        xqa = XQADecodeBackend(pool, req_to_token, num_q_heads, layers)
        xqa.load()
    except Exception as e:  # noqa: BLE001 - e.g. no CUDA compiler for FlashInfer's JIT
        if choice == "xqa":
            raise
        logger.warning("XQA decode kernel unavailable (%s: %s); FP8 decode uses FlashInfer's wrappers",
                       type(e).__name__, e)
        return None
    logger.info("FP8 KV cache: decode runs XQA's Hopper FP8 kernel")
    return xqa
