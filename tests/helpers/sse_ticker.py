"""An OpenAI-style streaming server that costs next to nothing per token: every `step_ms` one tick writes the next
SSE chunk (one short text piece) of every running /v1/completions stream, as a GPU's decode steps would, and a
stream ends after its max_tokens with a usage chunk and [DONE]. Timings are exact by construction (TTFT within a
step, every inter-token gap one step), so a client's statistics can be checked against them; and since it spends a
few microseconds a token, a client reading from it is what saturates first.

    python -m tests.helpers.sse_ticker --port 31800 --step-ms 10     # prints `ready <port>` once listening
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import List, Tuple

TOKEN = b'data: {"id":"cmpl-t","object":"text_completion","choices":[{"index":0,"text":" w","finish_reason":null}]}\n\n'
MODELS = json.dumps({"object": "list", "data": [{"id": "ticker", "object": "model"}]}).encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Ticker:
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.streams: List[Tuple[asyncio.StreamWriter, List[int], asyncio.Event]] = []  # (writer, [left], done)

    async def tick(self) -> None:
        next_t = time.perf_counter()
        piece = chunk(TOKEN)
        while True:
            next_t = max(next_t + self.step_s, time.perf_counter())
            await asyncio.sleep(next_t - time.perf_counter())
            still = []
            for writer, left, done in self.streams:
                left[0] -= 1
                writer.write(piece)
                if left[0]:
                    still.append((writer, left, done))
                else:
                    done.set()
            self.streams = still

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                if head.startswith(b"GET /v1/models"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(MODELS), MODELS))
                    continue
                n = int(json.loads(body)["max_tokens"])
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                done = asyncio.Event()
                self.streams.append((writer, [n], done))
                await done.wait()
                usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
                writer.write(chunk(b"data: " + json.dumps(usage).encode() + b"\n\n") + chunk(b"data: [DONE]\n\n")
                             + b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def main(port: int, step_ms: float) -> None:
    ticker = Ticker(step_ms / 1000)
    server = await asyncio.start_server(ticker.serve, "127.0.0.1", port, backlog=4096)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.gather(server.serve_forever(), ticker.tick())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--step-ms", type=float, default=10.0)
    a = ap.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(a.port, a.step_ms))
    else:
        uvloop.run(main(a.port, a.step_ms))
