#!/usr/bin/env python
"""How long a plain short request waits beside a heavy one: starts the default server (CPU), times a plain chat
request (max_tokens 8) alone, then again sent while each heavy request is being prepared and served.

The heavy requests: a chat request with many tools and tool_choice "required" (its call is a JSON-schema union of
every tool), completions with echo and logprobs 20 on a long prompt (every prompt position scored), and a regex with
nested bounded repeats. A heavy request may be refused (a grammar too costly to compile is a 400): its status is
reported. The plain request is sent PLAIN_DELAY_S after the heavy one, so that the heavy one is being prepared.

    python scripts/bench_heavy_requests.py [--cases tools,echo,regex] [--repeat 3] [-- server args...]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN_DELAY_S = 0.3  # the plain request goes this long after the heavy one
NUM_TOOLS = 200
ECHO_WORDS = 3000
NESTED_REGEX = "(a{1,200}){1,200}b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: Optional[dict], timeout: float = 900) -> Tuple[int, float, str]:
    """(status, seconds, body text); status 0 for a connection failure."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, time.perf_counter() - t0, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, time.perf_counter() - t0, e.read().decode()
    except OSError as e:
        return 0, time.perf_counter() - t0, str(e)


def plain_request() -> Tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                                    "temperature": 0}


def tools_request() -> Tuple[str, dict]:
    tools = [{"type": "function", "function": {
        "name": f"t{i}", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
        for i in range(NUM_TOOLS)]
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                                    "tools": tools, "tool_choice": "required", "max_tokens": 32, "temperature": 0}


def echo_request() -> Tuple[str, dict]:
    common = "the of and to in is it that was for on are with as he be at by this had not but from or have".split()
    words = " ".join(common[(i * 7) % len(common)] for i in range(ECHO_WORDS))
    return "/v1/completions", {"prompt": words, "echo": True, "logprobs": 20, "max_tokens": 1, "temperature": 0}


def regex_request() -> Tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a's."}], "max_tokens": 8,
                                    "regex": NESTED_REGEX, "temperature": 0}


CASES = {"tools": tools_request, "echo": echo_request, "regex": regex_request}


def beside(base: str, heavy: Tuple[str, dict]) -> Dict[str, Any]:
    """The plain request's latency sent PLAIN_DELAY_S after the heavy one; the heavy one's status and time."""
    result: Dict[str, Any] = {}

    def run_heavy() -> None:
        status, secs, text = post(base + heavy[0], heavy[1])
        result["heavy_status"], result["heavy_s"] = status, secs
        if status != 200:
            result["heavy_error"] = text[:200]

    t = threading.Thread(target=run_heavy)
    t.start()
    time.sleep(PLAIN_DELAY_S)
    status, secs, _ = post(base + plain_request()[0], plain_request()[1])
    result["plain_status"], result["plain_s"] = status, secs
    t.join()
    return result


def start_server(server_args: List[str], log_path: str, timeout: float = 600) -> Tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-P", "-m", "minisrv.launch_server", "--port", str(port), *server_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.time() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"the server did not become ready:\n{open(log_path).read()[-3000:]}")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each case (a repeated grammar hits the cache: "
                                                          "each run varies the heavy request so that it does not)")
    ap.add_argument("server_args", nargs="*", help="after --: passed to the server")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="minisrv-heavy-") as tmp:
        log_path = os.path.join(tmp, "server.log")
        proc, base = start_server(args.server_args, log_path)
        try:
            for _ in range(3):  # warm up
                post(base + plain_request()[0], plain_request()[1])
            alone = [post(base + plain_request()[0], plain_request()[1])[1] for _ in range(5)]
            print(f"plain alone: median {statistics.median(alone):.3f} s, max {max(alone):.3f} s", flush=True)
            for name in args.cases.split(","):
                for k in range(args.repeat):
                    path, body = CASES[name]()
                    body = dict(body, seed=k)  # (seed is not part of a grammar's cache key: see below)
                    if name == "regex":
                        body["regex"] = NESTED_REGEX.replace("200}b", f"{200 - k}}}b")
                    elif name == "tools":
                        body["tools"] = [dict(t, function=dict(t["function"], name=t["function"]["name"] + f"_{k}"))
                                         for t in body["tools"]]
                    elif name == "echo":
                        body["prompt"] = f"{k} " + body["prompt"]
                    r = beside(base, (path, body))
                    print(f"{name} #{k}: plain {r['plain_s']:.3f} s (status {r['plain_status']}); heavy "
                          f"{r['heavy_s']:.3f} s (status {r['heavy_status']}) {r.get('heavy_error', '')}",
                          flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            if os.environ.get("BENCH_HEAVY_LOG"):
                print(open(log_path).read()[-5000:])


if __name__ == "__main__":
    main()
