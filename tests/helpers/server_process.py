"""A real server process for the server tests: started on a free loopback port, ready when /health says so, stopped
with SIGTERM (and its engine process checked gone), or killed."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import pytest

httpx = pytest.importorskip("httpx")

STARTUP_TIMEOUT_S = 240
DEFAULT_ARGS = ("--max-total-tokens", "16384")  # a test may pass its own: the last value of a flag wins


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> List[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def spawned_children(pid: int) -> List[int]:
    """Live children of pid started by multiprocessing's spawn (not its resource tracker)."""
    out = []
    for c in children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(c)
        except OSError:
            pass
    return out


def gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")  # exited and reaped: a zombie still has its /proc entry


class Server:
    def __init__(self, *extra: str, module: str = "minisrv.launch_server", env: Optional[Dict[str, str]] = None
                 ) -> None:
        """module: what `python -m` runs (a test's own launcher may wrap the server's parts); env: variables set
        for it besides this process's."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", module, "--port", str(self.port), *DEFAULT_ARGS, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: List[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during startup:\n" + "".join(self.lines))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become ready:\n" + "".join(self.lines))

    def stop(self) -> int:
        """SIGTERM; the exit code. The engine process must be gone too (reaped, not left behind)."""
        kids = children(self.proc.pid) if self.proc.poll() is None else []
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        for k in kids:
            deadline = time.monotonic() + 10
            while not gone(k) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert gone(k), f"child process {k} outlived the server"
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            for k in children(self.proc.pid):
                try:
                    os.kill(k, signal.SIGKILL)
                except OSError:
                    pass
            self.proc.kill()
            self.proc.wait()


@contextmanager
def running(*extra: str) -> Iterator[Server]:
    """A ready server for the with-block; stopped after it, and its exit must be clean (its output is the message)."""
    s = Server(*extra)
    try:
        s.wait_ready()
        yield s
    finally:
        code = s.stop()
    assert code == 0, "".join(s.lines)
