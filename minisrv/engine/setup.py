"""Building an engine's parts: device and dtype, tokenizer, model, KV pool sized from the memory left, request
table, attention backend, CUDA graphs, model runner; once, before the first step."""
from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, FrozenSet, List, Optional, Tuple

import torch

from minisrv.attention import canonical, create_backend, device_sm, missing, resolve_backend, serves_window_pool
from minisrv.batch import ForwardMode
from minisrv.attention.cascade import CascadePolicy
from minisrv.config import DEFAULT_CPU_POOL_TOKENS, EngineConfig
from minisrv.kvcache import KVPool, PageAllocator, ReqToTokenTable, WindowRule, slots_for
from minisrv.kvcache.window import split_pool_pages, windowed_layers
from minisrv.distributed import Rendezvous, TensorParallel, init_tensor_parallel
from minisrv.kernels.qk_rope_store import warm_up as warm_up_qk_rope_store
from minisrv.models.args import ModelArgs
from minisrv.models.attention_options import features_of, layer_attention
from minisrv.models.eagle3 import Eagle3Head
from minisrv.models.layer_ops import LayerOps, fused_ops_for
from minisrv.models.sharding import check_divisible
from minisrv.models.fp8 import Fp8Linear
from minisrv.checkpoints.loader import ModelBuild, load_model, load_model_args, resolve_model_path
from minisrv.checkpoints.model_files import load_engine_tokenizer
from minisrv.checkpoints.pooling_config import PoolingConfig, resolve_pooling
from minisrv.utils import ceil_div

from .kernel_builds import KernelBuilds, StagedKernels, flashinfer_jobs
from .model_runner import ModelRunner, RunnerParts
from .pooling import Pooler
from .request import Request, SamplingParams
from .sampler import fused_sampling_kernel
from .speculative.eagle import load_draft_head
from .speculative.speculator import speculation_batch_limit
from .scheduler import ScheduledBatch

logger = logging.getLogger("minisrv")

GiB = 1 << 30
# a server's engine waits this long past its weights for FlashInfer modules that are only being loaded from the cache
# (a fraction of a second each) before it starts without them (StagedKernels)
STAGED_GRACE_S = 0.5
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}


def resolve_device(cfg: EngineConfig) -> torch.device:
    return torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(name: str, checkpoint_dtype: Optional[str], device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(checkpoint_dtype or "", torch.bfloat16)


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if name == "auto" else _KV_CACHE_DTYPES[name]


@dataclass
class EngineParts:
    """What the engine loop runs on, built by `build_engine_parts`."""

    device: torch.device
    model_path: str
    args: ModelArgs
    tokenizer: Any
    eos_ids: List[int]
    dtype: torch.dtype
    context_length: int
    page_size: int
    backend_name: str
    pool: KVPool
    allocator: PageAllocator
    table: ReqToTokenTable
    pad_row: int  # the table row CUDA-graph padding rows read (never a request's)
    runner: ModelRunner
    max_request_len: int  # prompt + output tokens one request may have
    workers: Optional[Any] = None  # rank 0 of a tensor-parallel engine: the other ranks' processes (TPWorkers)
    pooling: Optional[PoolingConfig] = None  # an embedding model's pooling (None: a generation model)
    staged_kernels: Optional[StagedKernels] = None  # kernels still building, to switch to between steps
    cache_write: Optional[threading.Thread] = None  # a GGUF's first load: the thread writing the cache's file
    draft_head: Optional[Eagle3Head] = None  # EAGLE3's (engine/speculative/eagle.py)
    # where the windowed layers keep only their window: their pages' allocator and which pages they read
    window_allocator: Optional[PageAllocator] = None
    window_rule: Optional[WindowRule] = None


def tp_device(device: torch.device, rank: int, per_node: int, base: int = 0) -> torch.device:
    """Rank r of a tensor-parallel group with `per_node` ranks on each node runs on its node's GPU
    base + r % per_node (or on the CPU, every rank)."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if base + per_node > count:
        raise ValueError(f"{per_node} tensor-parallel ranks a node from GPU {base} need GPUs {base}.."
                         f"{base + per_node - 1}; this machine has {count}")
    return torch.device("cuda", base + rank % per_node)


def check_tensor_parallel(cfg: EngineConfig) -> None:
    """What can be refused before any rank's process is started: the model's heads must divide over the ranks, the
    GPUs must be there, the fused all-reduce needs CUDA."""
    device = resolve_device(cfg)
    check_divisible(load_model_args(resolve_model_path(cfg.model), cfg.cache_dir), cfg.tp_size)
    if cfg.enable_flashinfer_allreduce_fusion and device.type != "cuda":
        raise ValueError("--enable-flashinfer-allreduce-fusion needs CUDA devices")
    tp_device(device, 0, cfg.ranks_per_node, cfg.base_gpu_id)


def build_engine_parts(cfg: EngineConfig, tp_rank: int = 0, rendezvous: Optional[Rendezvous] = None,
                       staged: bool = False) -> EngineParts:
    """One rank's parts. staged: start before FlashInfer's kernels are compiled (a server's engine, one rank; see
    kernel_builds.py). Under tensor parallelism every rank calls this with its rank and rank 0's rendezvous and
    builds the same parts for its shard (rank 0 alone has a tokenizer)."""
    t0 = time.perf_counter()
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)  # unseeded requests draw from torch's generator
    device = resolve_device(cfg)
    model_path = resolve_model_path(cfg.model)
    args = load_model_args(model_path, cfg.cache_dir)
    backend_name = resolve_backend(cfg.attention_backend, device, features_of(layer_attention(args)))
    if cfg.tp_size > 1 or cfg.base_gpu_id:
        device = tp_device(device, tp_rank, cfg.ranks_per_node, cfg.base_gpu_id)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    context_length = cfg.context_length or args.max_position_embeddings
    dtype = resolve_dtype(cfg.dtype, args.torch_dtype, device)
    ps = cfg.page_size or (16 if device.type == "cuda" else 1)
    if cfg.fp8_decode_kernel == "xqa" and (cfg.kv_cache_dtype != "fp8_e4m3"
                                           or backend_name.split(",")[-1] not in ("fi", "triton")):
        raise ValueError(f"--fp8-decode-kernel xqa is the decode over an FP8 KV cache where fi or triton would decode: "
                         f"it needs --kv-cache-dtype fp8_e4m3 and fi or triton decoding (fi, PREFILL,fi or "
                         f"PREFILL,triton); here the KV cache is {cfg.kv_cache_dtype} and the attention backend "
                         f"{backend_name}")
    # on CUDA, FlashInfer is imported and its builds started in a thread while the weights load; the layers' ops take
    # its kernels once both are done. Not beside a tensor-parallel group's set-up, which imports FlashInfer itself.
    fused_and_builds = None
    if device.type == "cuda":
        thread = ThreadPoolExecutor(1)
        fused_and_builds = thread.submit(_fused_and_builds, cfg, args, backend_name, dtype, device)
        thread.shutdown(wait=cfg.tp_size > 1)
    ops = LayerOps(fused_ops_for(device) if fused_and_builds is None else None)
    tp = init_tensor_parallel(tp_rank, cfg.tp_size, rendezvous, device,
                              (args.hidden_size, dtype) if cfg.enable_flashinfer_allreduce_fusion else None
                              ) if cfg.tp_size > 1 else TensorParallel.single()
    pooling = resolve_pooling(model_path, args, cfg.is_embedding)
    loaded = load_model(model_path, ModelBuild(args, dtype, device, context_length, ops, tp, cfg.quantization,
                                               embedding=pooling is not None),
                        cache_dir=cfg.cache_dir, gguf_weights=cfg.gguf_weights)
    model = loaded.model
    draft_head = load_draft_head(cfg, model, args, context_length, dtype, device) \
        if cfg.speculative_algorithm == "EAGLE3" else None
    kernels, builds = fused_and_builds.result() if fused_and_builds is not None else (ops.kernels, None)
    t_load = time.perf_counter() - t0
    serving_name = backend_name
    layers_pending = sampling_pending = False
    if builds is not None:
        builds.wait(timeout=STAGED_GRACE_S if staged and not tp.enabled and pooling is None else None)
        layers_pending = bool(set(builds.pending()) - {"sampling"})
        sampling_pending = "sampling" in builds.pending()
        if layers_pending:  # torch's norm, activation and rotary until FlashInfer's are built
            serving_name = staged_backend(backend_name, device, features_of(layer_attention(args)))
    if not layers_pending:
        ops.use(kernels)

    a, plan = args, model.plan
    kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, dtype)
    per_token = all_global = KVPool.bytes_per_token(a.num_layers, plan.num_kv_heads, a.head_dim, kv_dtype)
    if draft_head is not None:  # its one layer's keys and values beside every slot (EagleProposer)
        per_token += KVPool.bytes_per_token(1, draft_head.config.num_kv_heads, draft_head.config.head_dim, dtype)
    tokens = cfg.max_total_tokens
    if tokens is None:
        tokens = DEFAULT_CPU_POOL_TOKENS if device.type != "cuda" else \
            _gpu_pool_tokens(cfg, model, serving_name, args, dtype, kv_dtype, ps, context_length, per_token, device)
    tokens = tp.min_over_ranks(tokens)  # every rank holds the same pages (for its own heads)
    num_pages, window_pages = max(1, tokens // ps), 0
    layers = layer_attention(args, model.attention_sinks())
    # (where every backend this engine serves with reads such a pool; the others read every layer's full pages)
    window_layers, window_rule = windowed_layers([x.window for x in layers], context_length, ps) \
        if serves_window_pool(serving_name) and serves_window_pool(backend_name) else (frozenset(), None)
    if window_layers:  # the same memory, more of it for the full layers
        w = window_rule.window + ps
        num_pages, window_pages = split_pool_pages(
            tokens, a.num_layers, len(window_layers), cfg.swa_full_tokens_ratio, ps,
            least=min(cfg.chunked_prefill_size, context_length) + 2 * w,
            most=cfg.max_running_requests * w + cfg.max_prefill_tokens)
    graphs = device.type == "cuda" and not cfg.disable_cuda_graph and pooling is None
    # (with CUDA graphs, one more windowed page than the allocator hands out: padding rows write into it)
    pool = KVPool(a.num_layers, num_pages, ps, plan.num_kv_heads, a.head_dim, dtype, device, kv_dtype,
                  window_layers, window_pages + (1 if graphs and window_layers else 0))
    if loaded.kv_scales is not None:  # an FP8 checkpoint's calibrated K/V scales (before any graph is captured)
        if pool.quantized:
            pool.set_scales(*loaded.kv_scales)
        else:
            logger.info("the checkpoint's K/V scales are not used: the KV cache is %s (--kv-cache-dtype fp8_e4m3 "
                        "uses them)", str(dtype).replace("torch.", ""))
    allocator = PageAllocator(num_pages)
    table = ReqToTokenTable(cfg.max_running_requests + 1, context_length, device, windowed=bool(window_layers))
    pad_row = table.alloc_row()  # one spare row: CUDA-graph padding rows point at it
    pad_page = None
    max_request_len = min(context_length, pool.num_slots)
    if graphs:  # CUDA-graph padding rows write their dummy K/V into a page of their own
        pad_page = allocator.alloc(1)[0]
        table.write(pad_row, 0, slots_for([pad_page], ps, 0, ps))
        if window_layers:
            table.write(pad_row, 0, slots_for([window_pages], ps, 0, ps), window=True)
        max_request_len = min(context_length, pool.num_slots - ps)

    def attention_parts(current: RunnerParts, keep_backend: bool) -> RunnerParts:
        """The runner's parts with the attention backend asked for (the current one where it is that already), its
        CUDA graphs and cascade decode."""
        backend = current.backend if keep_backend else create_backend(
            backend_name, pool, table.table, plan.num_heads, cfg.fp8_decode_kernel, layers, table.window_table)
        graph_runner = _graph_runner(cfg, model, backend, pad_row, pad_page * ps, context_length, device) \
            if graphs and backend.supports_cuda_graph else None
        return replace(current, backend=backend, graph_runner=graph_runner,
                       cascade=_cascade_policy(cfg, backend, backend_name, pool, ps))

    serving = create_backend(serving_name, pool, table.table, plan.num_heads, cfg.fp8_decode_kernel, layers,
                             table.window_table)
    runner = ModelRunner(model, serving, table, device, tp, Pooler(pooling) if pooling is not None else None)
    parts = RunnerParts(serving, sampling_kernel=None if sampling_pending else fused_sampling_kernel(device))
    staged_kernels = None
    # a server's engine answers its first requests before capturing its CUDA graphs (kernel_builds.StagedKernels)
    graphs_later = staged and graphs and not layers_pending and not tp.enabled and builds is not None
    runner.use_parts(parts if layers_pending or graphs_later else attention_parts(parts, keep_backend=True))
    if layers_pending or sampling_pending or graphs_later:
        staged_kernels = StagedKernels(builds, ops, kernels, lambda current: attention_parts(current, graphs_later),
                                       backend_name, lambda: fused_sampling_kernel(device),
                                       f"attention {serving_name}, torch's norm, activation and rotary, no CUDA graphs"
                                       if layers_pending else f"attention {backend_name}",
                                       layers_pending=layers_pending or graphs_later, graphs_only=graphs_later)
    if tp.enabled and tp_rank == 0:
        table.journal = []  # from here on, the other ranks replay rank 0's table writes
    fp8_weights = any(isinstance(m, Fp8Linear) for m in model.modules())
    logger.info("model %s (%s, %s%s) on %s loaded in %.1fs%s%s", model_path, a.architecture,
                str(dtype).replace("torch.", ""), ", fp8 weights" if fp8_weights else "", device, t_load,
                "; fused ops on" if kernels is not None else "",
                f"; tensor parallel over {tp.size} ranks" + (", fused all-reduce + RMSNorm" if tp.fused_norm else "")
                if tp.enabled else "")
    logger.info("KV pool: %d tokens (%d pages of %d), %.2f GiB; context length %d; attention backend %s",
                pool.num_slots, num_pages, ps, pool.nbytes / GiB, context_length, backend_name)
    if window_layers:
        logger.info("KV pool: %d of %d layers keep only their window of %d tokens, in %d tokens of their own: "
                    "%.0f bytes per token of context, %.3f of every layer global", len(window_layers), a.num_layers,
                    window_rule.window, window_pages * ps, pool.nbytes / pool.num_slots,
                    pool.nbytes / pool.num_slots / all_global)
    if pooling is not None:
        logger.info("embedding model: %s", pooling.describe())
    if pool.quantized:
        logger.info("KV cache %s: %d tokens (%dx %s in the same memory; K/V scales %s)", cfg.kv_cache_dtype,
                    pool.num_slots, dtype.itemsize // kv_dtype.itemsize, str(dtype).replace("torch.", ""),
                    "from the checkpoint" if loaded.kv_scales is not None else "1.0")
    # after the weights: on a GGUF file's first start the HTTP process converts the tokenizer meanwhile (one process
    # converts, the other waits for its result), and this one dequantises the weights
    tokenizer = load_engine_tokenizer(model_path, cfg.tokenizer, cfg.cache_dir) if tp_rank == 0 else None
    eos = set(args.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return EngineParts(device, model_path, args, tokenizer, sorted(eos), dtype, context_length, ps, backend_name,
                       pool, allocator, table, pad_row, runner, max_request_len, pooling=pooling,
                       staged_kernels=staged_kernels, cache_write=loaded.cache_write, draft_head=draft_head,
                       window_allocator=PageAllocator(window_pages) if window_layers else None, window_rule=window_rule)


def _fused_and_builds(cfg: EngineConfig, args: ModelArgs, backend_name: str, dtype: torch.dtype,
                      device: torch.device) -> Tuple[Optional[Any], Optional[KernelBuilds]]:
    """The layers' fused ops on CUDA (FlashInfer's, when importable) and the builds of every FlashInfer module this
    engine will call (kernel_builds.py) and of the attention layers' Triton kernel; FA3's kernel imported ahead."""
    if missing("fa", device_sm(device)) is None:  # fa serves here (asked for, or standing in for fi)
        from minisrv.attention.fa import load_kernel
        load_kernel()
    fused = fused_ops_for(device)
    if fused is None:
        return None, None
    hq, hkv = args.num_heads // cfg.tp_size, max(1, args.num_kv_heads // cfg.tp_size)  # one rank's (sharding.py)
    parts = backend_name.split(",")
    kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, dtype)
    try:  # (FlashInfer's module getters are not its public API: another version may lack one)
        jobs = flashinfer_jobs(device, dtype, kv_dtype, args.head_dim, hq, hkv,
                               prefill_on_fi=parts[0] == "fi", decode_on_fi=parts[-1] == "fi")
    except Exception as e:  # noqa: BLE001 - then each module is built on first use, as without the builds
        logger.warning("FlashInfer's modules are built on first use, not ahead (%s: %s)", type(e).__name__, e)
        return fused, None
    if args.rotary_dim == args.head_dim:  # (a partial rotary does not take the fused kernel: qk_rope_store.py)
        jobs["triton"] = functools.partial(warm_up_qk_rope_store, device, dtype, hq, hkv, args.head_dim,
                                           args.qk_norm, store=kv_dtype == dtype)
    return fused, KernelBuilds(jobs)


def staged_backend(name: str, device: torch.device, features: FrozenSet[str] = frozenset()) -> str:
    """What serves attention while FlashInfer's kernels compile: `name` with fi replaced by fa (FA3's precompiled
    kernels) where fa runs here and serves the model's attention `features` (not a soft-capped Gemma 2), else by
    torch."""
    stand_in = "fa" if missing("fa", device_sm(device), features) is None else "torch"
    return canonical(",".join(stand_in if p == "fi" else p for p in name.split(",")))


def _graph_runner(cfg: EngineConfig, model: torch.nn.Module, backend: Any, pad_row: int, pad_slot: int,
                  context_length: int, device: torch.device) -> Any:
    from .cuda_graph import CudaGraphRunner, default_max_bs
    max_bs = min(cfg.cuda_graph_max_bs or default_max_bs(device), cfg.max_running_requests)
    verify_q_len = cfg.speculative_num_draft_tokens if cfg.speculative_algorithm is not None else 0
    return CudaGraphRunner(model, backend, pad_row, pad_slot, max_bs, context_length, device, verify_q_len,
                           speculation_batch_limit(cfg, device.type), cfg.speculative_algorithm == "EAGLE3")


def _cascade_policy(cfg: EngineConfig, backend: Any, backend_name: str, pool: KVPool,
                    page_size: int) -> Optional[CascadePolicy]:
    if not cfg.enable_cascade_attention:
        return None
    if pool.quantized:
        logger.warning("--enable-cascade-attention ignored: cascade decode reads a bfloat16/float16 pool, "
                       "not an FP8 one")
    elif backend.supports_cascade:
        backend.init_cascade_state()
        return CascadePolicy(page_size)
    else:
        logger.warning("--enable-cascade-attention ignored: the %s backend has no cascade decode for this model (fi "
                       "has, for models without sliding windows)", backend_name)
    return None


def _gpu_pool_tokens(cfg: EngineConfig, model: torch.nn.Module, backend_name: str, args: ModelArgs,
                     dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, context_length: int,
                     per_token: int, device: torch.device) -> int:
    """KV pool size from the GPU memory left after the weights and the largest prefill step's activations."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    n = min(cfg.chunked_prefill_size, cfg.max_prefill_tokens, context_length)
    peak = activation_peak(model, backend_name, args, dtype, page_size, context_length, n, device, kv_dtype)
    budget = min(total * cfg.mem_fraction_static - weights, free - peak - GiB)
    if budget < per_token * 4096:
        raise MemoryError(f"not enough GPU memory for a KV pool: {budget / GiB:.2f} GiB left after weights "
                          f"({weights / GiB:.2f} GiB) and activations ({peak / GiB:.2f} GiB)")
    logger.info("GPU memory: total %.1f GiB, weights %.2f GiB, activation peak %.2f GiB",
                total / GiB, weights / GiB, peak / GiB)
    return int(budget // per_token)


@torch.inference_mode()
def activation_peak(model: torch.nn.Module, backend_name: str, args: ModelArgs, dtype: torch.dtype,
                    page_size: int, context_length: int, num_tokens: int, device: torch.device,
                    kv_dtype: Optional[torch.dtype] = None) -> int:
    """Bytes a largest prefill step needs beyond the weights: one step of `num_tokens` run through a model runner
    of its own, on a throwaway pool just big enough (of the real pool's kv_dtype: an FP8 pool's store and query
    casts make temporaries of their own)."""
    a, n, plan = args, num_tokens, model.plan
    pool = KVPool(a.num_layers, ceil_div(n, page_size), page_size, plan.num_kv_heads, a.head_dim, dtype, device,
                  kv_dtype)
    table = ReqToTokenTable(1, context_length, device)
    # a prefill step only: no decode kernel to load
    backend = create_backend(backend_name, pool, table.table, plan.num_heads, fp8_decode_kernel="flashinfer",
                             layers=layer_attention(args, model.attention_sinks()))
    runner = ModelRunner(model, backend, table, device)
    req = Request([0] * n, SamplingParams(max_tokens=1), 1)
    req.row = table.alloc_row()
    req.pages = list(range(pool.num_pages))
    slots = slots_for(req.pages, page_size, 0, n)
    table.write(req.row, 0, slots)
    batch = ScheduledBatch(ForwardMode.EXTEND, [req], [n], slots)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.forward_logits(runner.build_forward_batch(batch))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner, pool, table
    torch.cuda.empty_cache()
    return peak
