"""How every kernel module here gets Triton: only when a launcher is first asked for (nothing imports a GPU library
at import time), once, and as None where Triton cannot be imported, so that the caller takes its torch path."""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Callable, Optional, TypeVar

Launcher = TypeVar("Launcher")


def triton_launcher(build: Callable[[ModuleType, ModuleType], Launcher]) -> Callable[[], Optional[Launcher]]:
    """Decorates `build(triton, tl)`, which defines a module's kernels and returns their launcher: the decorated
    function takes no arguments and returns that launcher (built on the first call, then cached), or None where
    Triton is missing."""
    @functools.lru_cache(maxsize=None)
    @functools.wraps(build)
    def launcher() -> Optional[Launcher]:
        try:
            import triton
            import triton.language as tl
        except Exception:  # noqa: BLE001 - any import failure means "not present"
            return None
        return build(triton, tl)
    return launcher
