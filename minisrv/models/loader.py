"""Checkpoints -> a ready model: the loading sequence. The model is built empty (no weight init), the tensor
source picked by the checkpoint's format (HF safetensors directory, GGUF file, either of them FP8), its tensors
written into the parameters one at a time, then the checkpoint's K/V scales attached.

The formats, the model's files and the parameter map live beside this module (model_files, safetensors_files,
gguf_file, fp8_checkpoint, weights); the names callers use are importable from here too."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from minisrv.distributed import TensorParallel

from .checkpoint import StoredTensor, WeightLoadError
from .fp8 import fp8_checkpoint_format
from .fp8_checkpoint import CheckpointKVScales, dequantized_fp8
from .gguf_file import iter_gguf
from .args import ModelArgs
from .model_files import (default_model_path, is_gguf, load_hf_config, load_model_args, load_tokenizer,
                          resolve_model_path)
from .registry import model_class
from .safetensors_files import iter_safetensors
from .weights import load_weights

__all__ = ["WeightLoadError", "StoredTensor", "default_model_path", "resolve_model_path", "is_gguf",
           "load_hf_config", "load_model_args", "load_tokenizer", "load_weights", "empty_model", "load_model"]


def empty_model(args: ModelArgs, dtype: torch.dtype, device: torch.device, max_positions: int,
                fused_ops: Optional[Any] = None, tp: Optional[TensorParallel] = None,
                quantization: Optional[str] = None, embedding: bool = False) -> nn.Module:
    """The model with its parameters allocated but not filled: built on the meta device (no weight init is run),
    with `dtype` as torch's default meanwhile so that every layer is made in the model's dtype as it is built (FP8
    layers keep their float8 weights and float32 scales: a cast afterwards would widen them). Its projections are
    FP8 layers with quantization "fp8" (filled by the loader, which quantises each tensor as it reads it).
    `embedding`: the decoder without its LM head (an embedding model's)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(args.architecture, embedding)(args, max_positions, fused_ops, tp,
                                                              quantization=quantization)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    for m in model.modules():  # buffers (rotary cos/sin) were lost on the meta device
        if hasattr(m, "reset_buffers"):
            m.reset_buffers(device)
    return model


def load_model(path: str, args: ModelArgs, dtype: torch.dtype, device: torch.device, max_positions: int,
               fused_ops: Optional[Any] = None, tp: Optional[TensorParallel] = None,
               quantization: Optional[str] = None, embedding: bool = False) -> nn.Module:
    """Build the model without running any weight init (meta device), then fill it from the checkpoint.
    `fused_ops`: the fused-kernel module its layers use (see layers.fused_ops_for), or None for plain torch.
    `tp`: this rank's place in a tensor-parallel group; only its shard is read and held.
    `quantization`: "fp8" makes the projection layers FP8 (see fp8.py), each checkpoint tensor quantised as it is
    read; an FP8 checkpoint always loads that way (dequantised, rounded to the model's dtype, requantised per row).
    `embedding`: an embedding model, without an LM head (a checkpoint's lm_head is then skipped).
    The model's `kv_scales` holds the checkpoint's per-layer K/V scales, or None."""
    fp8_format = fp8_checkpoint_format(args.quantization_config)
    model = empty_model(args, dtype, device, max_positions, fused_ops, tp,
                        "fp8" if quantization == "fp8" or fp8_format is not None else None, embedding)
    if is_gguf(path):  # quantised blocks are dequantised whole, one tensor at a time, then sliced
        source = ((name, StoredTensor.in_memory(w)) for name, w in iter_gguf(path, args))
    else:
        source = iter_safetensors(path)
    kv_scales = CheckpointKVScales(args.num_layers)
    if fp8_format is not None:
        source = dequantized_fp8(source, None if fp8_format == "tensor" else fp8_format, kv_scales)
    load_weights(model, source, args, model.plan)
    model.kv_scales = kv_scales.complete()
    return model.eval()
