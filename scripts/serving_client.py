"""The serving benchmark's client (scripts/bench_serving.py): streamed requests timed per SSE chunk, sent on a
schedule of arrival times, from one process or split over several.

One Python process reading every stream can fall behind a fast server: its event loop then stamps chunks late
(ITL and TTFT as the client's queue, not the server's) and reads the streams more slowly than they are written.
`run_requests(..., processes=N)` deals the requests round-robin to N worker processes, each with its own event loop
and HTTP client; they start from one shared start time, each request sent at its own offset from it (all at 0 at
rate inf; a Poisson process's arrival times otherwise, drawn once for the whole run), and their per-request
records come back in request order, so that the statistics are those of one client that kept up. Over plain http
a stream is read without an HTTP library (`bare_body`), with httpx over https (or with --httpx).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import random
import time
from dataclasses import dataclass, field
import urllib.parse
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

import httpx

try:
    from orjson import loads
except ImportError:  # orjson is optional: the standard parser reads bytes too
    from json import loads


@dataclass
class Item:
    prompt: Any  # str for completions, str (user message) or a messages list for chat
    max_tokens: int
    schema: Any = None  # a JSON schema: sent as response_format json_schema


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: List[float] = field(default_factory=list)
    start: float = 0.0  # when it was sent (its turn, or a free slot under --max-concurrency), from the run's start
    constrained: bool = False


def arrival_offsets(n: int, rate: float, seed: int) -> List[float]:
    """When each request is sent, in seconds from the run's start: all at 0 at rate inf, else a Poisson process
    (exponential gaps from Random(seed), the first request at 0)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        if rate != math.inf:
            t += rng.expovariate(rate)
    return out


def request_of(args: argparse.Namespace, model: str, item: Item) -> Tuple[str, Dict[str, Any]]:
    body: Dict[str, Any] = {"model": model, "max_tokens": item.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if item.schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": item.schema}}
    if args.endpoint == "chat":
        body["messages"] = item.prompt if isinstance(item.prompt, list) else \
            [{"role": "user", "content": item.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = item.prompt if isinstance(item.prompt, str) else json.dumps(item.prompt)
    return "/v1/completions", body


class StatusError(Exception):
    """An answer other than 200: its status and the start of its body."""


async def httpx_body(http: httpx.AsyncClient, url: str, body: Dict[str, Any]) -> AsyncIterator[bytes]:
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise StatusError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for part in r.aiter_bytes():
            yield part


async def bare_body(args: argparse.Namespace, url: str, body: Dict[str, Any]) -> AsyncIterator[bytes]:
    """The POST on a connection of its own (HTTP/1.1, plain http), its body read with the chunked framing taken
    off: an HTTP library's own cost per chunk read (h11's events, in httpx) is most of a streaming client's CPU."""
    base = urllib.parse.urlsplit(args.base_url)
    reader, writer = await asyncio.open_connection(base.hostname, base.port or 80, limit=1 << 20)
    try:
        data = json.dumps(body).encode()
        auth = f"Authorization: Bearer {args.api_key}\r\n" if args.api_key else ""
        writer.write(f"POST {base.path.rstrip('/')}{url} HTTP/1.1\r\nHost: {base.netloc}\r\n{auth}"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                     .encode() + data)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            raise StatusError(f"HTTP {status}: {(await reader.read(300)).decode(errors='replace')}")
        if b"transfer-encoding: chunked" not in head.lower():  # a body of known length, or one that ends the connection
            while part := await reader.read(1 << 16):
                yield part
            return
        raw = b""
        while True:
            part = await reader.read(1 << 16)
            if not part:
                raise ConnectionError("the stream ended before its last chunk")
            raw += part
            pieces = []
            while (i := raw.find(b"\r\n")) >= 0:  # each chunk: its size in hex, CRLF, its bytes, CRLF
                size = int(raw[:i].split(b";")[0], 16)
                if size == 0:
                    yield b"".join(pieces)
                    return
                if len(raw) < i + size + 4:
                    break
                pieces.append(raw[i + 2:i + 2 + size])
                raw = raw[i + size + 4:]
            if pieces:
                yield b"".join(pieces)
    finally:
        writer.close()


async def send(http: Optional[httpx.AsyncClient], args: argparse.Namespace, model: str, item: Item) -> Result:
    """One streamed request (with httpx, or without an HTTP library where `http` is None). The stream is cut into SSE
    events on the bytes (a blank line ends an event) and each event's data parsed once; a chunk that carries text
    is timed when it has been read."""
    res = Result(constrained=item.schema is not None)
    url, body = request_of(args, model, item)
    chunks = 0
    t0 = last = time.perf_counter()
    try:
        stream = bare_body(args, url, body) if http is None else httpx_body(http, url, body)
        async with contextlib.aclosing(stream):
            buf, done = b"", False
            async for part in stream:
                buf += part
                if b"\r" in buf:
                    buf = buf.replace(b"\r\n", b"\n")
                *events, buf = buf.split(b"\n\n")
                for line in (line for event in events for line in event.split(b"\n")):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    msg = loads(data)
                    if "error" in msg:
                        res.error = str(msg["error"])
                        return res
                    if msg.get("usage"):
                        res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                        res.output_tokens = msg["usage"].get("completion_tokens", 0)
                    got = False
                    for c in msg.get("choices") or []:
                        delta = c.get("delta") or {}
                        piece = c["text"] if "text" in c else delta.get("content") or delta.get("reasoning_content")
                        got = got or bool(piece)
                    if got:
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                if done:
                    break
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except (StatusError, httpx.HTTPError, OSError, EOFError, ValueError) as e:  # decode errors are ValueErrors
        res.error = str(e) if isinstance(e, StatusError) else f"{type(e).__name__}: {e}"
    return res


def http_client(args: argparse.Namespace) -> Any:
    """httpx's client for https (or with --httpx); None (requests sent without an HTTP library) for plain http."""
    if args.base_url.startswith("http://") and not getattr(args, "httpx", False):
        return contextlib.nullcontext()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(args.timeout), limits=limits,
                             headers=headers)


async def warm_up(args: argparse.Namespace, model: str, items: List[Item]) -> None:
    schema = next((item.schema for item in items if item.schema is not None), None)
    async with http_client(args) as http:
        for _ in range(args.warmup):
            await send(http, args, model, Item(items[0].prompt, min(8, items[0].max_tokens)))
            if schema is not None:  # the grammar's compile, once per server, is not what is measured
                await send(http, args, model, Item(items[0].prompt, min(8, items[0].max_tokens), schema))


Share = List[Tuple[int, Item, float]]  # (the request's index in the run, the request, its arrival offset)


async def run_share(args: argparse.Namespace, model: str, share: Share, concurrency: int,
                    start_time: Callable[[], float]) -> Tuple[List[Tuple[int, Result]], float, float]:
    """Send `share` on its schedule from the run's start (a time.time() shared by every worker, which
    `start_time()` gives once this process is ready to send); returns its records, when it ended (time.time())
    and the CPU seconds this process spent on it."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def go(index: int, item: Item, offset: float) -> Tuple[int, Result]:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem or contextlib.nullcontext():
            sent = time.perf_counter() - start
            try:
                res = await asyncio.wait_for(send(http, args, model, item), args.timeout)
            except asyncio.TimeoutError:
                res = Result(error=f"no answer in {args.timeout} s", constrained=item.schema is not None)
        res.start = sent
        return index, res

    async with http_client(args) as http:  # made first: an HTTP client's set-up is no part of the run
        start_wall = start_time()
        start = time.perf_counter() + (start_wall - time.time())
        cpu = time.process_time()
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        records = await asyncio.gather(*(go(*x) for x in share))
        return records, time.time(), time.process_time() - cpu


def run_coroutine(coro: Any) -> Any:
    """asyncio.run on uvloop's event loop where it is installed (cheaper per chunk read)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def worker_main(conn: Any, args: argparse.Namespace, model: str, share: Share, concurrency: int) -> None:
    def start_time() -> float:
        conn.send("ready")
        return conn.recv()

    conn.send(run_coroutine(run_share(args, model, share, concurrency, start_time)))


def run_requests(args: argparse.Namespace, model: str, items: List[Item], rate: float,
                 processes: int) -> Tuple[List[Result], float, float]:
    """Every item sent (after the warm-up) from `processes` processes; returns the records in item order, the run's
    wall time (from the shared start to the last answer) and the CPU seconds the client processes spent."""
    run_coroutine(warm_up(args, model, items))
    offsets = arrival_offsets(len(items), rate, args.seed)
    cap = args.max_concurrency or 0
    processes = max(1, min(processes, len(items), cap or len(items)))
    shares = [[(i, items[i], offsets[i]) for i in range(k, len(items), processes)] for k in range(processes)]
    caps = [cap // processes + (k < cap % processes) for k in range(processes)]  # all 0 without a cap
    if processes == 1:
        start_wall = math.nan

        def start_now() -> float:
            nonlocal start_wall
            start_wall = time.time()
            return start_wall

        outs = [run_coroutine(run_share(args, model, shares[0], caps[0], start_now))]
    else:
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(processes)]
        workers = [ctx.Process(target=worker_main, args=(child, args, model, share, c), daemon=True)
                   for (_, child), share, c in zip(pipes, shares, caps)]
        for w in workers:
            w.start()
        for _, child in pipes:
            child.close()  # so that a worker that dies is an EOFError here, not a wait
        for parent, _ in pipes:
            parent.recv()  # every worker is ready to send before the clock starts
        start_wall = time.time() + 0.05
        for parent, _ in pipes:
            parent.send(start_wall)
        outs = [parent.recv() for parent, _ in pipes]
        for w in workers:
            w.join()
    records = sorted((r for out in outs for r in out[0]), key=lambda r: r[0])
    return [res for _, res in records], max(out[1] for out in outs) - start_wall, sum(out[2] for out in outs)
