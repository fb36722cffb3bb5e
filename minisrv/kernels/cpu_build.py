"""The CPU kernels written in C (`cpu_*.c` beside this module), compiled once for the machine they run on.

torch offers no attention that reads K/V through a page table on the CPU, so a few small C kernels do that. They are
compiled with the system's C compiler on first use, for this CPU (`-march=native`, so AVX2, AVX-512 or NEON as
the machine has), into a cache directory keyed by the source, the flags and the compiler; later processes load the
cached library in milliseconds. They use OpenMP: once torch is imported its `libgomp.so.1` is already loaded, so
the kernels share torch's threads instead of starting a second pool that would fight it for the cores.

Where no compiler works, `load_cpu_library` returns None and the callers keep their plain torch path; the reason is
logged once per process by whoever asked.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional, Tuple, Type, TypeVar

from minisrv import env

logger = logging.getLogger(__name__)

I64, INT, FLOAT, PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p  # the C kernels' argument types

SOURCE_DIR = Path(__file__).resolve().parent
# tried in order: the first set the compiler accepts is used (-march=native is refused by a few cross compilers)
FLAG_SETS: Tuple[Tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast"),
    ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"),
)


def cache_dir() -> Path:
    """$MINISRV_KERNEL_CACHE, else $XDG_CACHE_HOME/minisrv/cpu_kernels (~/.cache by default)."""
    explicit = env.KERNEL_CACHE.get()
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minisrv" / "cpu_kernels"


def _compile(cc: str, source: Path, flags: Tuple[str, ...], target: Path) -> Optional[str]:
    """Compile source into target (atomically: concurrent processes may race); None, or the compiler's complaint."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-shared", "-fPIC", str(source), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return (done.stderr or done.stdout).strip()[-500:]
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def load_cpu_library(name: str) -> Tuple[Optional[ctypes.CDLL], str]:
    """(the compiled `name`.c, a line saying how it was built) or (None, why not). Cached per process: the library
    is the same for every caller. The cache key covers the sources `name`.c includes from this directory."""
    source = SOURCE_DIR / f"{name}.c"
    cc = next((cc for cc in (os.environ.get("CC"), "cc", "gcc", "clang") if cc and shutil.which(cc)), None)
    if cc is None:
        return None, "no C compiler found (CC, cc, gcc, clang)"
    text = source.read_bytes()
    for included in re.findall(rb'^#include "([^"]+)"', text, flags=re.M):  # a source built from others
        text += (SOURCE_DIR / included.decode()).read_bytes()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(text + " ".join((cc, *flags)).encode()).hexdigest()[:16]
        target = cache_dir() / f"{name}-{key}.so"
        if not target.exists():
            err = _compile(cc, source, flags, target)
            if err is not None:
                errors.append(f"{' '.join(flags)}: {err}")
                continue
        try:
            return ctypes.CDLL(str(target)), f"{name}.c built by {cc} {' '.join(flags)}"
        except OSError as e:
            errors.append(f"{target}: {e}")
    return None, "; ".join(errors)


def c_function(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
    """lib's C function `name` with its signature declared (ctypes would otherwise pass and return C ints)."""
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


Kernels = TypeVar("Kernels", bound="CompiledKernels")


class CompiledKernels:
    """Base of the classes that wrap one compiled library, `SOURCE`.c, built as `__init__(lib, how)` from it."""

    SOURCE: str

    @classmethod
    def load(cls: Type[Kernels]) -> Tuple[Optional[Kernels], str]:
        """(the kernels, a line saying how they were built), or (None, why they could not be)."""
        lib, how = load_cpu_library(cls.SOURCE)
        return (cls(lib, how) if lib is not None else None), how
