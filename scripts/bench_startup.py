#!/usr/bin/env python
"""Start-up time: from `python -m minisrv.launch_server` to the first chat answer, in a fresh process, and where the
time went.

Each run starts a server process, polls /health until it answers 200 (ready), then sends one chat completion
(max_tokens 1) and times its answer (first answer). The server's log (--log-level info, with timestamps) splits the
time: imports, config and tokenizer (launch to the first log line), weights ("loaded in"), memory sizing and graph
capture (up to the ready line), and the first request. --fresh-caches points Triton's and FlashInfer's caches at empty
directories, as on a fresh machine (kernels FlashInfer ships prebuilt in its package are still found there). A server
that started before FlashInfer's kernels were built (engine/kernel_builds.py) is kept, with --until-built, until it has
switched to them (`full_kernels`: launch to the switch) and asked once more, so that the next run finds them in the
cache.

  python scripts/bench_startup.py [--runs 3] [--fresh-caches] [--until-built] -- [server flags, e.g. --model /tmp/qwen3]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: Optional[dict] = None, timeout: float = 600) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _log_times(log: str) -> Dict[str, float]:
    """Wall-clock seconds (epoch) of the log's landmarks."""
    marks: Dict[str, float] = {}
    for line in log.splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        marks.setdefault("first_log", t)
        if " loaded in " in line:
            marks["weights_done"] = t
        if "graph" in line.lower() and "captur" in line.lower():
            marks["graphs_done"] = t
        if "kernels all serve now" in line:
            marks["switched"] = t
    return marks


def _resident_mib(pid: int) -> float:
    """Resident memory of a process and its children (the engine), MiB."""
    total = 0
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(x) for x in f.read().split()]
        for p in pids:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return float("nan")
    return total / 1024


def _chat(base: str, max_tokens: int) -> int:
    return _get(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": max_tokens, "temperature": 0})


def _wait_until_built(base: str, log_path: str, t0: float, timeout: float) -> None:
    """Wait for a staged server's switch to FlashInfer's kernels, then ask it once more."""
    while True:
        log = open(log_path).read()
        if "kernels are not built yet" not in log or "kernels all serve now" in log:
            break
        if time.time() - t0 > timeout:
            raise RuntimeError(f"the server did not switch to FlashInfer's kernels:\n{log[-3000:]}")
        time.sleep(0.5)
    status = _chat(base, 8)
    if status != 200:
        raise RuntimeError(f"the request after the switch answered {status}:\n{open(log_path).read()[-3000:]}")


def run_once(server_args: List[str], fresh_caches: bool, timeout: float, empty_gguf_cache: bool = False,
             print_log: bool = False, until_built: bool = False) -> Dict[str, float]:
    port = free_port()
    env = dict(os.environ)
    tmp = tempfile.TemporaryDirectory(prefix="minisrv-startup-")
    if fresh_caches:
        env["TRITON_CACHE_DIR"] = os.path.join(tmp.name, "triton")
        env["FLASHINFER_WORKSPACE_BASE"] = tmp.name
    log_path = os.path.join(tmp.name, "server.log")
    # the server of this script's own tree (an earlier tree's copy of this script starts that tree's server):
    # its root first on the path, and not the working directory (-P)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-P", "-m", "minisrv.launch_server", "--port", str(port), "--log-level", "info",
           *server_args]
    if empty_gguf_cache:
        cmd += ["--cache-dir", os.path.join(tmp.name, "gguf-cache")]
    t0 = time.time()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        while _get(base + "/health", timeout=5) != 200:
            if proc.poll() is not None or time.time() - t0 > timeout:
                raise RuntimeError(f"the server did not become ready:\n{open(log_path).read()[-3000:]}")
            time.sleep(0.05)
        ready = time.time()
        status = _chat(base, 1)
        answered = time.time()
        if status != 200:
            raise RuntimeError(f"the first request answered {status}:\n{open(log_path).read()[-3000:]}")
        time.sleep(0.5)
        resident = _resident_mib(proc.pid)
        if until_built:
            _wait_until_built(base, log_path, t0, timeout)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    log = open(log_path).read()
    marks = _log_times(log)
    if print_log:
        print("\n".join(line for line in log.splitlines() if STAMP.match(line))[-12000:], flush=True)
    tmp.cleanup()
    first_log = marks.get("first_log", t0)
    weights = marks.get("weights_done", first_log)
    return {"to_first_log": first_log - t0, "weights": weights - first_log, "sizing_and_graphs": ready - weights,
            "ready": ready - t0, "first_request": answered - ready, "first_answer": answered - t0,
            "resident_MiB": resident, **({"full_kernels": marks.get("switched", ready) - t0} if until_built else {})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--fresh-caches", action="store_true", help="empty Triton/FlashInfer caches for every run")
    p.add_argument("--empty-gguf-cache", action="store_true", help="an empty GGUF cache (--cache-dir) every run")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--print-log", action="store_true", help="print each run's timestamped server log lines")
    p.add_argument("--until-built", action="store_true",
                   help="keep a server that started before its kernels were built until it has switched to them")
    p.add_argument("--json", help="append the medians as a JSON line here")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: the server's flags")
    a = p.parse_args()
    server_args = a.server_args[1:] if a.server_args[:1] == ["--"] else a.server_args
    runs = [run_once(server_args, a.fresh_caches, a.timeout, a.empty_gguf_cache, a.print_log, a.until_built)
            for _ in range(a.runs)]
    keys = list(runs[0])
    print(f"{'phase':<18} " + " ".join(f"run {i + 1:>2}" for i in range(len(runs))) + "   median")
    for k in keys:
        vals = [r[k] for r in runs]
        unit = " MiB" if k.endswith("MiB") else " s"
        print(f"{k:<18} " + " ".join(f"{v:6.2f}" for v in vals) + f"   {statistics.median(vals):6.2f}{unit}")
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps({"args": server_args, "fresh_caches": a.fresh_caches,
                                "empty_gguf_cache": a.empty_gguf_cache,
                                **{k: round(statistics.median(r[k] for r in runs), 3) for k in keys}}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
