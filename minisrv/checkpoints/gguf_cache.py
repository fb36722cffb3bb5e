"""The on-disk cache of what is slow to rebuild from a GGUF file (seconds each for the default model on 2 cores; tens
of milliseconds from here): its HF config, its tokenizer (a HF tokenizer folder) and the loaded model's parameters
(a safetensors file, mapped back into the model without a copy).

Where: cache_dirs.cache_root ("off" turns it off), one folder per GGUF path, and in it one per version of the file:
its fingerprint hashes the cache format, the file's size and modification time, its header, 64 samples of the rest
and its tail, so a changed file is never read stale; older versions' entries go once the new one is written. The
parameters are stored as the model holds them (fused, in its dtype, FP8 or not, one rank's shard): one file per set
of load options and per version of the model code.

Every file is written under a temporary name and renamed into place (a folder likewise), so a server starting beside
another never reads a half-written entry; an entry that cannot be read is rebuilt."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional

from minisrv.cache_dirs import cache_root

logger = logging.getLogger("minisrv")

CACHE_FORMAT = 1  # bump when what an entry holds, or how the tensors are made, changes
HEADER_BYTES = 4 << 20
SAMPLES = 64
SAMPLE_BYTES = 4 << 10
TAIL_BYTES = 64 << 10
SOURCE_FILE = "gguf-path"  # in a path's folder: the GGUF file it caches (its folder goes when the file does)


def gguf_fingerprint(path: str) -> str:
    """A hash of what identifies this version of the file (see the module's docstring)."""
    st = os.stat(path)
    h = hashlib.sha256(f"minisrv-gguf-cache {CACHE_FORMAT} {st.st_size} {st.st_mtime_ns}\n".encode())
    with open(path, "rb") as f:
        h.update(f.read(HEADER_BYTES))
        rest = st.st_size - HEADER_BYTES
        if rest > 0:
            for i in range(SAMPLES):
                f.seek(HEADER_BYTES + rest * i // SAMPLES)
                h.update(f.read(SAMPLE_BYTES))
            f.seek(max(HEADER_BYTES, st.st_size - TAIL_BYTES))
            h.update(f.read(TAIL_BYTES))
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class GGUFCache:
    """The cache entry of one version of one GGUF file (its folder need not exist yet)."""

    gguf: str
    folder: str  # <root>/<path hash>-<file name>/<fingerprint>

    @classmethod
    def open(cls, gguf: str, setting: Optional[str]) -> Optional["GGUFCache"]:
        """The entry for the file as it is now; None when the cache is off or the file cannot be read (the loader then
says what is wrong with it)."""
        root = cache_root(setting)
        if root is None:
            return None
        gguf = os.path.abspath(gguf)
        try:
            fingerprint = gguf_fingerprint(gguf)
        except OSError:
            return None
        path_key = hashlib.sha256(gguf.encode()).hexdigest()[:16]
        return cls(gguf, os.path.join(root, f"{path_key}-{os.path.basename(gguf)}", fingerprint))

    @property
    def config_file(self) -> str:
        return os.path.join(self.folder, "config.json")

    @property
    def tokenizer_dir(self) -> str:
        return os.path.join(self.folder, "tokenizer")

    def model_file(self, options: str) -> str:
        """The parameters of the model loaded with `options` (dtype, quantisation, shard, ...)."""
        return os.path.join(self.folder, f"model-{options}-{model_code_hash()}.safetensors")

    def why_missing(self, what: str) -> str:
        """Why `what` is not in the entry, for the log: an older version of the file was cached, or none was."""
        if os.path.isdir(self.folder):
            return f"no {what} in the cache yet"
        if _versions(os.path.dirname(self.folder)):
            return "the GGUF file changed since it was cached (size, modification time or contents differ)"
        return "first use of this file"

    @contextlib.contextmanager
    def building(self, what: str) -> Iterator[None]:
        """Held while `what` is built, so that a process that needs it too (the HTTP and engine processes both want the
tokenizer; two servers may start at once) waits and reads the result; without a writable folder, nothing is held."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(os.path.join(self.folder, f".lock-{what}"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (releases the lock)

    def read_or_build(self, what: str, read: Callable[[], Any], build: Callable[[], Any],
                      publish: Callable[[Any], bool]) -> Any:
        """read() where the entry holds `what`, else build() and publish(value) it, one process at a time (another
        one building it: wait, then read its result)."""
        value = read()
        if value is not None:
            return value
        why = self.why_missing(what)  # (before building() makes the entry's folder)
        with self.building(what):
            value = read()
            if value is None:
                value = build()
                if publish(value):
                    logger.info("GGUF cache: %s built from the GGUF file (%s); cached in %s", what, why, self.folder)
        return value

    def read_config(self) -> Optional[Dict[str, Any]]:
        try:
            with open(self.config_file) as f:
                cfg = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("GGUF cache: config %s unreadable (%s): rebuilding it", self.config_file, e)
            return None
        if isinstance(cfg, dict):
            logger.info("GGUF cache: config read from %s", self.config_file)
            return cfg
        return None

    def publish(self, final: str, write: Any, folder: bool = False) -> bool:
        """Run write(temporary path) and rename the result to `final` (atomic: readers see the old file or the whole
        new one; a folder already there, broken or another process's, is replaced), then prune what it supersedes;
        False (logged) if it could not be written: the cache is an aid, a full disk must not stop the server."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            prefix = f".{os.path.basename(final)}."
            if folder:
                tmp = tempfile.mkdtemp(dir=self.folder, prefix=prefix)
            else:
                fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=prefix)
                os.close(fd)
        except OSError as e:
            logger.warning("GGUF cache: cannot write in %s (%s); going on without it", self.folder, e)
            return False
        try:
            write(tmp)
            os.chmod(tmp, 0o755 if folder else 0o644)  # (mkdtemp / mkstemp make it private)
            if folder:
                _discard(final)  # (os.replace replaces a folder only if it is empty)
            os.replace(tmp, final)
        except Exception as e:  # noqa: BLE001 - a failed cache write is logged, never fatal
            logger.warning("GGUF cache: cannot write %s (%s); going on without it", final, e)
            _discard(tmp)
            return False
        self.prune_older()
        return True

    def prune_older(self) -> None:
        """Remove what this write supersedes: the entries of this path's earlier versions, model files made by
        other versions of minisrv's model code, and the entries of GGUF files that no longer exist."""
        parent = os.path.dirname(self.folder)
        for d in _versions(parent):
            if d != os.path.basename(self.folder):
                _discard(os.path.join(parent, d))
        code = model_code_hash()
        for name in _listdir(self.folder):
            if name.startswith("model-") and name.endswith(".safetensors") \
                    and not name.endswith(f"-{code}.safetensors"):
                _discard(os.path.join(self.folder, name))
        with contextlib.suppress(OSError), open(os.path.join(parent, SOURCE_FILE), "w") as f:
            f.write(self.gguf)
        root = os.path.dirname(parent)
        for d in _listdir(root):
            source = os.path.join(root, d, SOURCE_FILE)
            try:
                with open(source) as f:
                    gone = not os.path.exists(f.read())
            except OSError:
                continue
            if gone:
                _discard(os.path.join(root, d))


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT_CODE = (os.path.join(PACKAGE, "checkpoints"), os.path.join(PACKAGE, "models"))  # what lays parameters out


def model_code_hash(folders=LAYOUT_CODE) -> str:
    """A hash of the sources that decide how a loaded model's parameters are laid out (the loaders and the model)."""
    h = hashlib.sha256()
    for folder in folders:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(os.path.basename(folder).encode() + b"/" + name.encode() + b"\0" + f.read())
    return h.hexdigest()[:12]


def _listdir(path: str) -> list:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _versions(parent: str) -> list:
    """The entries (one a version of the file) in a GGUF path's folder."""
    return [d for d in _listdir(parent) if not d.startswith(".") and d != SOURCE_FILE]


def _discard(path: str) -> None:
    """Remove a file or a folder, if it is there (a cache entry going: failures are ignored)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)
