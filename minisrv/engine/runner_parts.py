"""What a model runner's steps run on besides the model, handed over in one piece (`ModelRunner.use_parts`) by setup
at start and by the start-up switch to kernels built meanwhile (kernel_builds.StagedKernels)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from minisrv.attention.base import AttentionBackend
from minisrv.attention.cascade import CascadePolicy


@dataclass(frozen=True)
class RunnerParts:
    backend: AttentionBackend
    graph_runner: Optional[Any] = None  # CUDA-graph decode, when enabled
    cascade: Optional[CascadePolicy] = None  # when decode steps run as cascade attention (None: never)
    sampling_kernel: Optional[Callable] = None  # FlashInfer's draw (sampler.fused_sampling_kernel); None: torch's
