"""Checkpoints -> a ready model: built empty (no weight init), its tensors read from the checkpoint's format (HF
safetensors directory or GGUF file, either FP8) into the parameters one at a time, returned as a `LoadedModel`.
The formats live beside this module; the names callers use are importable from here too."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from minisrv.distributed import TensorParallel

from .checkpoint import StoredTensor, WeightLoadError
from minisrv.models.fp8 import fp8_checkpoint_format
from .fp8_checkpoint import CheckpointKVScales, dequantized_fp8
from minisrv.models.gguf_blocks import blocks_unavailable_here, blocks_unavailable_in
from .gguf_cache import GGUFCache
from .gpt_oss_experts import gpt_oss_experts
from .int4_formats import int4_tensors
from minisrv.kernels.w4a16_gemm import w4a16_gemm
from minisrv.models.args import ModelArgs, check_architecture
from .model_files import (default_model_path, is_gguf, load_hf_config, load_model_args, load_tokenizer,
                          resolve_model_path)
from minisrv.models.llama import LlamaForCausalLM
from minisrv.models.w4a16 import int4_scheme
from .safetensors_files import iter_safetensors
from .safetensors_stream import BadFile, SafetensorsStream, map_tensors
from .weights import load_weights

logger = logging.getLogger("minisrv")

__all__ = ["WeightLoadError", "StoredTensor", "default_model_path", "resolve_model_path", "is_gguf",
           "load_hf_config", "load_model_args", "load_tokenizer", "load_weights", "ModelBuild", "LoadedModel",
           "empty_model", "load_model"]


@dataclass(frozen=True)
class ModelBuild:
    """How a model is built: its shape, dtype and device, the layers' kernels (models/layer_ops.py's LayerOps;
    None: torch's), this rank's place in a tensor-parallel group, the projections' quantization (None, "fp8",
    "gguf", or a 4-bit checkpoint's models/w4a16.Int4Scheme) and whether it is an embedding model (no LM head)."""

    args: ModelArgs
    dtype: torch.dtype
    device: torch.device
    max_positions: int
    ops: Optional[Any] = None
    tp: Optional[TensorParallel] = None
    quantization: Optional[Any] = None
    embedding: bool = False


@dataclass
class LoadedModel:
    """What `load_model` loaded: the model (in eval mode); the checkpoint's per-layer K/V scales, or None; on a GGUF
model's first load, the thread writing its parameters to the cache (join it before the process ends)."""

    model: nn.Module
    kv_scales: Optional[Tuple[List[float], List[float]]] = None
    cache_write: Optional[threading.Thread] = None


def empty_model(build: ModelBuild, tensors: Optional[Dict[str, torch.Tensor]] = None) -> nn.Module:
    """The model with its parameters allocated but not filled: built on the meta device with `dtype` as torch's default
meanwhile, so that every layer is made in the model's dtype (FP8 layers keep their float8 weights and float32
scales: a cast afterwards would widen them). `tensors`: a state dict to use as the parameters themselves (a mapped
cache file) instead of empty ones."""
    model = _meta_model(build)
    _materialize(model, build.device, tensors)
    for m in model.modules():  # buffers (rotary cos/sin) were lost on the meta device
        if hasattr(m, "reset_buffers"):
            m.reset_buffers(build.device)
    return model


def _meta_model(b: ModelBuild) -> nn.Module:
    check_architecture(b.args.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(b.dtype)
    try:
        with torch.device("meta"):
            return LlamaForCausalLM(b.args, b.max_positions, b.ops, b.tp, b.quantization, b.embedding)
    finally:
        torch.set_default_dtype(previous)


def _materialize(model: nn.Module, device: torch.device, tensors: Optional[Dict[str, torch.Tensor]]) -> None:
    """Every meta parameter and buffer replaced: by its tensor in `tensors` (moved to `device`), else by an empty
    one. (model.to_empty does the latter through torch's meta-device references, whose first use imports sympy:
    about a second.)"""
    for prefix, m in model.named_modules():
        for slot in (m._parameters, m._buffers):
            for name, t in slot.items():
                if t is None:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                new = tensors[full].to(device) if tensors is not None and full in tensors else \
                    torch.empty(t.shape, dtype=t.dtype, device=device)
                slot[name] = nn.Parameter(new, requires_grad=t.requires_grad) if slot is m._parameters else new


def load_model(path: str, build: ModelBuild, cache_dir: Optional[str] = None,
               gguf_weights: str = "auto") -> LoadedModel:
    """Build the model empty, then fill it from the checkpoint (only this rank's shard under `build.tp`). An FP8
checkpoint always loads with FP8 projections (dequantised, rounded to the model's dtype, requantised per row), as
`build.quantization` "fp8" loads any; a 4-bit one (AWQ, GPTQ, compressed-tensors: models/w4a16.py) with 4-bit
projections; gpt-oss's MXFP4 experts stay in MXFP4 on CUDA and are dequantised elsewhere.
`cache_dir`: where a GGUF model's parameters are cached (None: the default).
`gguf_weights`: a GGUF model's projections and embedding kept in their blocks ("blocks": on the CPU as the C kernels'
records, on CUDA as the W4A16 GEMM's planes), dequantised ("float32": to the model's dtype), or "auto": blocks where
they can be."""
    qc = build.args.quantization_config
    mxfp4 = (qc or {}).get("quant_method") == "mxfp4"  # gpt-oss's experts (gpt_oss_experts.py)
    int4 = int4_scheme(qc)
    if (int4 is not None or mxfp4) and build.quantization is not None:
        raise ValueError(f"--quantization {build.quantization} cannot requantise this {int4 or 'mxfp4'} checkpoint")
    fp8_format = fp8_checkpoint_format(qc) if int4 is None else None
    build = replace(build, quantization=int4 or ("fp8" if build.quantization == "fp8" or fp8_format is not None
                                                 else None))
    if mxfp4 and build.device.type == "cuda":  # kept in 4 bits (the CPU's dequantised to the model's dtype)
        build = replace(build, quantization="mxfp4")
    if is_gguf(path):
        cache = GGUFCache.open(path, cache_dir)
        blocks, reader = _keep_blocks(path, build, gguf_weights, cache)
        return _load_gguf(path, replace(build, quantization=blocks) if blocks else build, cache, reader)
    model = empty_model(build)
    source = iter_safetensors(path)
    kv_scales = CheckpointKVScales(build.args.num_layers)
    if fp8_format is not None:
        source = dequantized_fp8(source, None if fp8_format == "tensor" else fp8_format, kv_scales)
    if int4 is not None:
        source = int4_tensors(source, int4)
    if build.args.architecture == "GptOssForCausalLM":
        source = gpt_oss_experts(source, keep_mxfp4=build.quantization == "mxfp4")
    load_weights(model, source, build.args, model.plan)
    return LoadedModel(model.eval(), kv_scales.complete())


def _keep_blocks(path: str, build: ModelBuild, setting: str,
                 cache: Optional[GGUFCache]) -> Tuple[Optional[str], Optional[Any]]:
    """The quantization a GGUF model keeps its blocks in ("gguf" on the CPU, "gguf-planes" on CUDA) or None, as
`setting` asks and the file allows, and the file's header where it was read to decide (else None); why not is
logged, or raised where blocks were asked for."""
    if setting == "float32":
        return None, None
    device, tp = build.device, build.tp
    gpu = device.type == "cuda"
    kernels = w4a16_gemm() if gpu else build.ops.block_kernels if device.type == "cpu" and build.ops is not None \
        else None
    why = blocks_unavailable_here(build.args, device, build.dtype, tp is not None and tp.enabled, build.quantization,
                                  kernels)
    kind = "gguf-planes" if gpu else "gguf"
    if why is None:
        cached = not gpu and cache is not None and os.path.isfile(cache.model_file(_cache_options(
            replace(build, quantization=kind))))
        if setting == "auto" and cached:
            return kind, None  # cached in blocks: this file was found fit for them before (no header read)
        from .gguf_file import hf_name, read_gguf
        reader = read_gguf(path)
        why = blocks_unavailable_in(reader, hf_name, gpu)
    if why is None:
        logger.info("GGUF weights kept in their blocks (%s)", "planes for the W4A16 GEMM" if gpu else
                    f"1.25 bytes a weight; {kernels.how}")
        return kind, reader
    if setting == "blocks":
        raise ValueError(f"--gguf-weights blocks: cannot keep this model's blocks: {why}")
    logger.info("GGUF weights dequantised to %s: %s", str(build.dtype).replace("torch.", ""), why)
    return None, None


def _cache_options(build: ModelBuild) -> str:
    """The load options a cached model file is named by."""
    tp = build.tp
    return "-".join([str(build.dtype).replace("torch.", ""), build.quantization or "noquant",
                     f"tp{tp.rank}of{tp.size}" if tp is not None and tp.enabled else "tp1",
                     "embed" if build.embedding else "lm"])


def _load_gguf(path: str, build: ModelBuild, cache: Optional[GGUFCache],
               reader: Optional[Any] = None) -> LoadedModel:
    """A GGUF model: mapped from the cache's file for these load options, else dequantised from the GGUF (one tensor
    at a time) and written to the cache. `reader`: the file's header if it was read already."""
    t0 = time.perf_counter()
    if cache is None or build.quantization == "gguf-planes":  # planes: made from the file's blocks as fast as read
        return LoadedModel(_dequantised_model(path, build, t0, reader))
    options = _cache_options(build)
    file = cache.model_file(options)
    model, why = _cached_model(file, build, cache, t0)
    if model is not None:
        return LoadedModel(model)
    with contextlib.ExitStack() as held:
        held.enter_context(cache.building(f"model-{options}"))  # another process building it: wait, then map its file
        if os.path.isfile(file) and why != "the cached file was unreadable":
            model, why = _cached_model(file, build, cache, t0)
            if model is not None:
                return LoadedModel(model)
        model = _dequantised_model(path, build, t0, reader)
        # the file is written by a thread that holds the building lock until it is whole (a process that starts
        # meanwhile waits for it, then maps it), while the engine already serves: the write is a large part of a
        # first start
        lock = held.pop_all()
    writer = threading.Thread(target=_store_model, args=(cache, file, model, why, lock), name="gguf-cache-write")
    writer.start()
    return LoadedModel(model, cache_write=writer)


def _cached_model(file: str, build: ModelBuild, cache: GGUFCache, t0: float) -> Tuple[Optional[nn.Module], str]:
    """(the model over the cache file's tensors, "") or (None, why it could not be): the file must hold exactly the
    model's parameters (names, shapes, dtypes)."""
    if not os.path.isfile(file):
        return None, cache.why_missing("model file for these options")
    try:
        tensors = map_tensors(file)
        want = _meta_model(build).state_dict()
        if set(want) != set(tensors):
            raise BadFile(f"it holds {len(tensors)} tensors, the model has {len(want)} parameters")
        for name, t in want.items():
            if tuple(t.shape) != tuple(tensors[name].shape) or t.dtype != tensors[name].dtype:
                raise BadFile(f"{name} is {tuple(tensors[name].shape)} {tensors[name].dtype}, the model's "
                              f"{tuple(t.shape)} {t.dtype}")
    except BadFile as e:
        logger.warning("GGUF cache: %s cannot be used (%s): rebuilding it", file, e)
        return None, "the cached file was unreadable"
    model = empty_model(build, tensors=tensors).eval()
    logger.info("GGUF cache: parameters mapped from %s in %.2fs", file, time.perf_counter() - t0)
    return model, ""


def _dequantised_model(path: str, build: ModelBuild, t0: float, reader: Optional[Any] = None) -> nn.Module:
    from .gguf_file import iter_gguf, read_gguf
    if reader is None:  # (the blocks check may have read it) a truncated or damaged file is refused here
        reader = read_gguf(path)
    model = empty_model(build)
    blocks = build.quantization in ("gguf", "gguf-planes")
    load_weights(model, ((n, StoredTensor.in_memory(w)) for n, w in iter_gguf(path, build.args, reader, blocks)),
                 build.args, model.plan)
    logger.info("GGUF cache: parameters %s from the GGUF file in %.2fs", "read in blocks" if blocks else "dequantised",
                time.perf_counter() - t0)
    return model.eval()


def _store_model(cache: GGUFCache, file: str, model: nn.Module, why: str, lock: contextlib.ExitStack) -> None:
    """Write the dequantised parameters to the cache (`why`: why it had no file), then release the building lock."""
    t0 = time.perf_counter()
    try:
        if cache.publish(file, lambda tmp: _write_model(tmp, model)):
            logger.info("GGUF cache: parameters written in %.2fs (%s); cached in %s", time.perf_counter() - t0,
                        why, file)
    finally:
        lock.close()


def _write_model(file: str, model: nn.Module) -> None:
    """The model's parameters, wider dtypes first (so that every tensor is aligned to its element size)."""
    state = sorted(model.state_dict().items(), key=lambda kv: -kv[1].element_size())
    out = SafetensorsStream(file, len(state))
    for name, t in state:
        out.add(name, t)
    if not out.close(complete=True):
        raise OSError(f"cannot write {file}: {out.error}")
