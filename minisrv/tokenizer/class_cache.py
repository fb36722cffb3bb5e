"""The transformers class AutoTokenizer gives a checkpoint folder, remembered across starts.

A tokenizer saved under a generic class name beside a config.json gets its model type's class from AutoTokenizer
(a Qwen3 checkpoint: Qwen2Tokenizer), which costs importing AutoTokenizer's tables (transformers' config machinery
and torch: seconds on the path to the first answer). An entry is keyed by the folder, the size and time of change of
its tokenizer_config.json and config.json, and transformers' version."""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from typing import Optional

from minisrv.cache_dirs import cache_root

FILES = ("tokenizer_config.json", "config.json")


def _entry(folder: str, cache_dir: Optional[str]) -> Optional[str]:
    root = cache_root(cache_dir)
    if root is None:
        return None
    try:
        stats = [os.stat(os.path.join(folder, f)) for f in FILES]
        version = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    key = "\n".join([os.path.realpath(folder), version] + [f"{s.st_size} {s.st_mtime_ns}" for s in stats])
    return os.path.join(root, "tokenizer-classes", hashlib.sha256(key.encode()).hexdigest()[:32])


def remembered_class(folder: str, cache_dir: Optional[str]) -> Optional[str]:
    entry = _entry(folder, cache_dir)
    try:
        with open(entry) as f:  # type: ignore[arg-type]
            name = f.read().strip()
    except (OSError, TypeError):
        return None
    return name if name.isidentifier() else None


def remember_class(folder: str, cache_dir: Optional[str], name: str) -> None:
    """Write the entry (atomically; a folder that cannot be written is no error: the cache is an aid)."""
    entry = _entry(folder, cache_dir)
    if entry is None:
        return
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(entry), prefix=".class.")
        with os.fdopen(fd, "w") as f:
            f.write(name)
        os.replace(tmp, entry)
    except OSError:
        pass
