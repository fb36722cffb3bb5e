"""The environment variables minisrv reads, declared once: each switch's name, type, default and meaning. Code reads
a switch through its `get()`, at the moment it needs it (nothing is read at import)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvSwitch(Generic[T]):
    name: str
    parse: Callable[[str], T]  # the variable's text -> its value
    default: T  # when the variable is not set
    meaning: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        return self.default if raw is None else self.parse(raw)


CACHE_DIR: EnvSwitch[Optional[str]] = EnvSwitch(
    "MINISRV_CACHE_DIR", str, None,
    "the on-disk cache's folder when --cache-dir is not given ('off' or empty: no cache; unset: "
    "$XDG_CACHE_HOME/minisrv, see cache_dirs.py)")
KERNEL_CACHE: EnvSwitch[Optional[str]] = EnvSwitch(
    "MINISRV_KERNEL_CACHE", str, None,
    "where the CPU kernels are compiled to (empty or unset: $XDG_CACHE_HOME/minisrv/cpu_kernels; kernels/cpu_build.py)")
TORCH_SAMPLING: EnvSwitch[bool] = EnvSwitch(
    "MINISRV_TORCH_SAMPLING", lambda raw: raw == "1", False,
    "1: sample with torch's kernels on CUDA rather than FlashInfer's one-kernel draw (engine/sampler.py)")
