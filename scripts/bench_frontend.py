#!/usr/bin/env python
"""CPU the HTTP process spends per generated token, with the model taken out.

What it measures: the real server process (`minisrv.server.launch_server`: the app, request planning and the chat
template, the engine client, streaming, JSON and SSE encoding, uvicorn) serving many concurrent requests, while its
engine process runs a stand-in (`StandInEngine`) that gives every running request one token a step, every
`--step-ms`, up to `--max-running` requests at once, as a GPU's decode steps would. The stand-in keeps the engine's
per-token work: each request's text is made by the engine's own incremental detokenizer (TextStream, with the
default model's tokenizer) and its finish checks (Engine._news: stop strings, max_tokens, usage counts), so the
messages the HTTP process receives are those of a real engine. Its tokens are real text's (a passage of common
words, tokenized, each request reading it from its own place).

The figure is the server process's own CPU time (user + system, from /proc via psutil: every thread of that process,
not the engine's nor this client's) over a run, divided by the tokens the run generated (the usage the answers
report), in microseconds; tokens/s is over the run's wall time. Each scenario runs --repeat times after one warm-up
run, and the medians are printed. The load comes from this process (a bare HTTP/1.1 client), on the same machine.

  python scripts/bench_frontend.py                                  # every scenario, 256 requests each
  python scripts/bench_frontend.py --scenarios chat-stream --requests 512 --step-ms 10
  python scripts/bench_frontend.py --trees /tmp/before,.            # two checkouts, runs alternating
  python scripts/bench_frontend.py --profile-pid-file /tmp/pid      # writes the server's pid (py-spy record -p)
  python scripts/bench_frontend.py --serve-only --port 30000 --step-ms 1 --max-running 1024
                                          # keeps the stand-in server up for another client (bench_serving.py)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

# scenarios: name -> the kinds of request it sends, in turn (endpoint, streamed)
SCENARIOS: Dict[str, List[Tuple[str, bool]]] = {
    "chat-stream": [("chat", True)],
    "completion-stream": [("completion", True)],
    "chat": [("chat", False)],
    "mixed": [("chat", True), ("completion", True), ("chat", True), ("chat", False), ("completion", False)],
}
PASSAGE = ("the old man walked down to the water every morning and looked out at the boats that came back with the "
           "night's catch. some days there were many fish, and the children ran along the sand to see them; other "
           "days the sea was grey and quiet, and the boats came in empty. he had worked on those boats for forty "
           "years, and he knew each one by the sound of its engine. \"it will rain before noon,\" he said to nobody "
           "in particular, and went home to make his tea. ")


# ------------------------------------------------------------------------------------------ the engine stand-in
class StandInEngine:
    """What engine_proc's loop calls of an Engine (make_request, add, abort, has_work, step, stats, ...), without a
    model: requests are admitted at once up to `max_running`, and each step, paced `step_s` apart, gives every
    running request the next token of the passage through the engine's own finish checks and detokenizer."""

    def __init__(self, cfg: Any, staged_kernels: bool = False) -> None:
        from types import SimpleNamespace

        from minisrv.checkpoints.loader import load_tokenizer
        from minisrv.checkpoints.model_files import resolve_model_path
        from minisrv.engine.request import RequestLimits
        from minisrv.engine.text import decode_cleans_up
        path = resolve_model_path(cfg.model)
        tok = load_tokenizer(path)
        self.step_s = float(os.environ["BENCH_STEP_MS"]) / 1000
        self.max_running = int(os.environ["BENCH_MAX_RUNNING"])
        eos = tuple(i for i in (tok.eos_token_id,) if i is not None)
        self.parts = SimpleNamespace(model_path=path, backend_name="stand-in", device="cpu", context_length=32768,
                                     max_request_len=32768, args=SimpleNamespace(vocab_size=len(tok)), pooling=None,
                                     tokenizer=tok, eos_ids=eos)
        self.limits = RequestLimits(len(tok), 32768)
        self.clean_up = decode_cleans_up(tok)
        self.passage = tok.encode(PASSAGE * 8, add_special_tokens=False)
        self.staged_kernels = None
        self.scheduler = self  # Engine._news calls scheduler.finish
        self.running: List[Any] = []
        self.waiting: List[Any] = []
        self.num_cached_prompt_tokens = 0
        self.next_step = time.monotonic()

    def make_request(self, prompt_ids: Any, params: Any, rid: Optional[str] = None) -> Any:
        from minisrv.engine.request import Request, check_request
        return Request(list(prompt_ids), params, check_request(prompt_ids, params, self.limits), rid,
                       eos_ids=self.parts.eos_ids)

    def add(self, req: Any) -> Any:
        from minisrv.engine.text import TextStream
        p = req.params
        req.text = TextStream(self.parts.tokenizer, req.prompt_ids, p.stop, p.skip_special_tokens, self.clean_up)
        req.cursor = sum(req.prompt_ids) % len(self.passage)
        self.waiting.append(req)
        return req

    def abort(self, rid: str) -> Any:
        from minisrv.engine.request import RequestOutput
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    return RequestOutput.ended(req, "abort")
        return None

    def finish(self, req: Any, reason: str) -> None:
        self.running.remove(req)
        req.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> List[Any]:
        from minisrv.engine.request import TokenLogprob
        from minisrv.engine.step_results import SampledToken
        self.next_step = max(self.next_step + self.step_s, time.monotonic())
        time.sleep(max(0.0, self.next_step - time.monotonic()))
        outputs = []
        for req in list(self.running):
            tok = self.passage[req.cursor % len(self.passage)]
            req.cursor += 1
            req.output_ids.append(tok)
            n = req.params.logprobs
            lp = None if n is None else TokenLogprob(tok, -0.5, {tok: -0.5, **{tok + i: -1.0 - i for i in range(1, n)}})
            outputs.append(self.news(SampledToken(req, tok, lp)))
        free = self.max_running - len(self.running)
        self.running += self.waiting[:free]
        del self.waiting[:free]
        return outputs

    def stats(self) -> Dict[str, Any]:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting)}

    def flush_cache(self) -> bool:
        return not self.has_work()

    def switch_kernels(self, idle: bool = False) -> List[Any]:
        return []

    def close(self) -> None:
        pass

    def finish_cache_write(self, timeout: float = 0.0) -> None:
        pass


if __name__ == "__mp_main__":  # the engine process, spawned by a server started with --serve: no model
    import minisrv.engine.engine
    StandInEngine.news = minisrv.engine.engine.Engine._news  # the engine's own finish checks and text
    minisrv.engine.engine.Engine = StandInEngine  # engine_main imports Engine from here when it starts


# ------------------------------------------------------------------------------------------------- the load
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompt(rng: random.Random, words: int) -> str:
    pool = PASSAGE.split()
    return " ".join(rng.choice(pool) for _ in range(words))


async def one_request(port: int, kind: str, stream: bool, prompt: str, max_tokens: int) -> int:
    """Send one request on a connection of its own and read its whole answer; returns its completion_tokens (its
    usage). A bare HTTP/1.1 client: on a machine of few cores, an HTTP library's own cost per chunk would take CPU
    from the server measured."""
    body: Dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream, "temperature": 0}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(f"{path}: {head.splitlines()[0].decode()}")
        if b"transfer-encoding: chunked" in head:
            tail = b""
            while not tail.endswith(b"\r\n0\r\n\r\n"):  # the last chunk
                part = await reader.read(1 << 16)
                if not part:
                    raise RuntimeError(f"{path}: the stream ended early")
                tail = (tail + part)[-8192:]
            last = tail[tail.rindex(b'data: {"id"') + 6:]
            return json.loads(last[:last.index(b"\n\n")])["usage"]["completion_tokens"]
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        return json.loads(await reader.readexactly(length))["usage"]["completion_tokens"]
    finally:
        writer.close()


async def run_load(port: int, scenario: str, n: int, in_words: int, out_len: int, seed: int) -> int:
    rng = random.Random(seed)
    kinds = SCENARIOS[scenario]
    jobs = [one_request(port, *kinds[i % len(kinds)], make_prompt(rng, in_words), rng.randint(out_len // 2, out_len))
            for i in range(n)]
    return sum(await asyncio.gather(*jobs))


def start_server(args: argparse.Namespace, tree: str, port: int) -> subprocess.Popen:
    """The server of the checkout at `tree` (its minisrv imported), with this script's engine stand-in."""
    env = dict(os.environ, BENCH_STEP_MS=str(args.step_ms), BENCH_MAX_RUNNING=str(args.max_running))
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--port", str(port), "--log-level", "warning",
           "--max-running-requests", str(args.max_running)]
    return subprocess.Popen(cmd, env=env, cwd=tree)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready")


def serve_only(args: argparse.Namespace, tree: str) -> None:
    import signal
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` ends the server too, as Ctrl-C does
    port = args.port or free_port()
    proc = start_server(args, tree, port)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        print(f"stand-in server ready: http://127.0.0.1:{port} (pid {proc.pid}; step {args.step_ms} ms, "
              f"{args.max_running} running at most)", flush=True)
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="chat-stream,completion-stream,chat,mixed",
                    help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--requests", type=int, default=256, help="requests per run, all sent at once")
    ap.add_argument("--input-words", type=int, default=256, help="words of each prompt (about a token each)")
    ap.add_argument("--output-len", type=int, default=256, help="max_tokens uniform in [len/2, len]")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the stand-in engine's step time")
    ap.add_argument("--max-running", type=int, default=256, help="requests the stand-in runs at once")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile-pid-file", default=None, help="write the server's pid here once it is ready")
    ap.add_argument("--trees", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="comma-separated checkouts to compare (default: this one): each serves from its own "
                         "server, and their runs alternate, so that each sees the same load on the machine")
    ap.add_argument("--serve-only", action="store_true",
                    help="start the first tree's stand-in server on --port and keep it up until interrupted, "
                         "for a client of one's own (e.g. scripts/bench_serving.py, to measure the client's cap)")
    ap.add_argument("--port", type=int, default=None, help="the port of --serve-only (default: a free one)")
    args = ap.parse_args()
    if args.serve_only:
        serve_only(args, os.path.abspath(args.trees.split(",")[0]))
        return
    import psutil
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    servers: List[Tuple[int, subprocess.Popen]] = []
    try:
        for tree in trees:
            port = free_port()
            servers.append((port, start_server(args, tree, port)))
        for port, proc in servers:
            wait_ready(f"http://127.0.0.1:{port}", proc)
        if args.profile_pid_file:
            with open(args.profile_pid_file, "w") as f:
                f.write(str(servers[0][1].pid))
        print("| tree | scenario | us CPU / token (median) | runs | of which system | tokens/s (median) "
              "| tokens / run | load avg |")
        print("|---|---|---|---|---|---|---|---|")
        for scenario in args.scenarios.split(","):
            per_token, system, rates = ([[] for _ in trees] for _ in range(3))
            tokens = 0
            for run in range(args.repeat + 1):  # the first is a warm-up
                for i, (port, proc) in enumerate(servers):
                    server = psutil.Process(proc.pid)
                    c0, t0 = server.cpu_times(), time.perf_counter()
                    load = run_load(port, scenario, args.requests, args.input_words, args.output_len, run)
                    tokens = asyncio.run(load)
                    c1, t1 = server.cpu_times(), time.perf_counter()
                    if run:
                        per_token[i].append(((c1.user - c0.user) + (c1.system - c0.system)) / tokens * 1e6)
                        system[i].append((c1.system - c0.system) / tokens * 1e6)
                        rates[i].append(tokens / (t1 - t0))
            for i, tree in enumerate(trees):
                runs = " ".join(f"{x:.1f}" for x in per_token[i])
                print(f"| {os.path.basename(tree)} | {scenario} | {statistics.median(per_token[i]):.1f} | {runs} "
                      f"| {statistics.median(system[i]):.1f} | {statistics.median(rates[i]):,.0f} | {tokens} "
                      f"| {os.getloadavg()[0]:.2f} |", flush=True)
    finally:
        for _, proc in servers:
            proc.terminate()
        for _, proc in servers:
            proc.wait(30)


if __name__ == "__main__":
    if "--serve" in sys.argv:
        sys.argv.remove("--serve")
        from minisrv.server.launch_server import main as serve
        serve()
    else:
        main()
