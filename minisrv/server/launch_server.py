"""`minisrv-server` / `python -m minisrv.launch_server`: the OpenAI-compatible server.

Startup: bind the port (a busy port fails at once, not after the model loads), serve (503 meanwhile), spawn the
engine process (one per --dp-size replica: replicas.py) and load the tokenizer alongside; print one ready line, or
the startup error and exit 1.
SIGINT/SIGTERM: running requests get --graceful-shutdown-timeout seconds (see http/transport.py), then the engine
process is asked to stop, terminated if it does not, and reaped; exit code 0."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from typing import Any, Coroutine, List, NoReturn, Optional

from minisrv.config import EngineConfig, setup_logging
from minisrv.server.plan.reasoning import PARSERS as REASONING_PARSERS
from minisrv.server.plan.tools import PARSERS

from .http.policy import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_READ_TIMEOUT_S, HTTPPolicy, split_list

logger = logging.getLogger("minisrv.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
GRACEFUL_SHUTDOWN_S = 5.0
KEEP_ALIVE_S = 5
YOUNG_GC_OBJECTS = 10_000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minisrv-server",
                                description="OpenAI-compatible LLM server (flag names follow SGLang's).")
    EngineConfig.add_cli_args(p)
    p.add_argument("--dp-size", "--dp", dest="dp_size", type=int, default=1,
                   help="data parallelism: this many engine replicas (each on --tp-size GPUs of its own, tp x dp "
                        "in all) behind this server; requests go where their prefix is cached, else to the least "
                        "loaded (default %(default)s)")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the basename of the model path)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on every route but /health")
    p.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                   help="Host header values answered besides the loopback names (NAME or NAME:PORT); '*' allows "
                        "all. Bound to a loopback address, Host is always checked; bound to another address, "
                        "only when this is given")
    p.add_argument("--tool-call-parser", default="auto", choices=PARSERS,
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3), "
                        "llama3_json (Llama 3.x), or auto (read from the chat template)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a thinking model's <think>...</think> into reasoning_content: qwen3 (the model "
                        "opens it), deepseek_r1 (the prompt opens it: DeepSeek-R1 and its distills), or auto (read "
                        "from the chat template); enables thinking_budget (default: off, the thinking stays in "
                        "content)")
    p.add_argument("--allowed-origins", default=None, metavar="O1,O2",
                   help="browser origins (scheme://host[:port]) whose requests are served, with CORS headers (and "
                        "preflights answered without the API key); '*' allows any. By default a request that "
                        "carries an Origin header is refused (403)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted (413 beyond; default %(default)s = 8 MiB)")
    p.add_argument("--request-read-timeout", type=float, default=DEFAULT_REQUEST_READ_TIMEOUT_S,
                   help="seconds a client has to send a request's head, and again its body (408) "
                        "(default %(default)s)")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=GRACEFUL_SHUTDOWN_S,
                   help="on SIGTERM/SIGINT, seconds running requests have to finish before they are ended "
                        "(default %(default)s)")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="most connections and requests at once; beyond, uvicorn answers 503 (default: no limit)")
    p.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection is kept open (default %(default)s)")
    return p


def _check_server_args(args: argparse.Namespace) -> None:
    limit = args.limit_concurrency
    for ok, rule in ((args.dp_size >= 1, "--dp-size must be >= 1"),
                     (args.dp_size == 1 or args.nnodes == 1, "--dp-size > 1 runs on one machine (--nnodes 1)"),
                     (args.max_request_bytes >= 1, "--max-request-bytes must be >= 1"),
                     (args.request_read_timeout > 0, "--request-read-timeout must be > 0"),
                     (args.graceful_shutdown_timeout >= 0, "--graceful-shutdown-timeout must be >= 0"),
                     (limit is None or limit >= 1, "--limit-concurrency must be >= 1"),
                     (args.timeout_keep_alive >= 1, "--timeout-keep-alive must be >= 1")):
        if not ok:
            _fail(rule, 2)


def _say(msg: str) -> None:
    print(f"minisrv-server: {msg}", file=sys.stderr, flush=True)


def _fail(msg: str, code: int = 1) -> NoReturn:
    _say(f"error: {msg}")
    sys.exit(code)


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.listen(2048)  # (not inherited by the engine process: Python's sockets never are)
    return sock


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        setup_logging(args.log_level)
    except ValueError:
        _fail(f"unknown --log-level {args.log_level!r}", 2)
    try:
        cfg = EngineConfig.from_args(args)
    except ValueError as e:
        _fail(str(e), 2)
    _check_server_args(args)
    if cfg.node_rank > 0:  # node 0 serves; this node runs only its tensor-parallel ranks
        from minisrv.engine.tp_workers import serve_node
        code = serve_node(cfg)
        logging.shutdown()
        # not sys.exit: the node watch's thread may sit in a store call, and torch's store aborts the interpreter's
        # shutdown under it (exit -6 instead of the code)
        os._exit(code)
    from minisrv.checkpoints.model_files import resolve_model_path
    try:
        model_path = resolve_model_path(cfg.model)
    except FileNotFoundError as e:
        _fail(str(e))
    try:
        sock = _listen(args.host, args.port)
    except OSError as e:
        _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    try:
        policy = HTTPPolicy.for_bind(sock.getsockname()[0], split_list(args.allowed_hosts),
                                     split_list(args.allowed_origins), max_request_bytes=args.max_request_bytes,
                                     request_read_timeout=args.request_read_timeout)
    except ValueError as e:
        sock.close()
        _fail(str(e), 2)
    served = args.served_model_name or os.path.basename(os.path.normpath(model_path))
    aliases = sorted({a for a in (cfg.model, model_path, os.path.abspath(model_path)) if a})
    try:
        code = _run(_serve(args, cfg, model_path, sock, served, aliases, policy))
    except KeyboardInterrupt:
        code = 130
    finally:
        sock.close()
    sys.exit(code)


def _run(main: Coroutine[Any, Any, int]) -> int:
    """asyncio.run, on uvloop's event loop where it is installed: a stream costs the event loop a wake-up, a write and
    a few callbacks every token, which uvloop's loop, written in C, does for a fraction of asyncio's CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _serve(args: argparse.Namespace, cfg: EngineConfig, model_path: str, sock: socket.socket,
                 served: str, aliases: List[str], policy: HTTPPolicy) -> int:
    from .replicas import Replicas

    # uvicorn handles SIGINT/SIGTERM while it runs, restores the handlers it found when it stops, then re-raises the
    # signal; with these no-op handlers underneath, that re-raise (or a second Ctrl-C) cannot cut the engine
    # shutdown below short.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _s, _f: None)

    # the engine process is spawned first, so that it loads while this process imports the HTTP side and loads the
    # tokenizer (on a small CPU model, both take about as long as the engine's start)
    client = Replicas(cfg, args.dp_size)
    engine_start = asyncio.create_task(client.start())
    await asyncio.sleep(0)  # start() runs up to the spawn
    import uvicorn
    from minisrv.checkpoints.model_files import load_tokenizer
    from .app import create_app
    from .state import ServerState
    from .http.transport import GracefulServer, deadline_protocol

    state = ServerState(client=client, served_model_name=served, model_aliases=aliases, api_key=args.api_key,
                        http=policy, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser)
    debug = args.log_level.lower() == "debug"
    config = uvicorn.Config(create_app(state), log_level="debug" if debug else "warning", access_log=debug,
                            lifespan="off", http=deadline_protocol(args.request_read_timeout),
                            timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency)
    server = GracefulServer(config, state, args.graceful_shutdown_timeout)
    client.on_death = lambda: setattr(server, "should_exit", True)

    async def start() -> None:
        # the engine loads in its process while this one loads the tokenizer; /health is 503 until both are done
        def tokenizer() -> object:
            loaded = load_tokenizer(model_path, cfg.tokenizer, cfg.cache_dir)
            state.use_tokenizer(loaded)  # (requests are still refused: no engine info yet)
            return loaded

        tok = asyncio.create_task(asyncio.to_thread(tokenizer))
        try:
            info = await engine_start
        except BaseException:
            tok.cancel()
            raise
        state.attach(await tok, info)

    # serving starts at once (503 while loading); the engine's failure or a signal ends it
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    starting = asyncio.create_task(start())
    try:
        await asyncio.wait({serving, starting}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # uvicorn stopped first: a signal during startup, or it could not serve
            starting.cancel()
            if serving.exception() is not None:
                _say(f"error: the HTTP server failed: {serving.exception()}")
                return 1
            _say("interrupted during startup")
            return 130
        try:
            starting.result()
        except Exception as e:  # noqa: BLE001 - any startup failure: reported, then a clean exit
            engine_failed = engine_start.done() and not engine_start.cancelled() and engine_start.exception()
            what = "the engine failed to start" if engine_failed else "cannot load the tokenizer"
            _say(f"error: {what}: {e}")
            return 1  # (the finally below stops the server)
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            from minisrv.utils import freeze_startup_heap
            # serving allocates a few objects a token per stream: the start-up heap is left out of the collector's
            # walk, and the young generation is collected every YOUNG_GC_OBJECTS allocations rather than 700
            freeze_startup_heap()
            gc.set_threshold(YOUNG_GC_OBJECTS, *gc.get_threshold()[1:])
            host = f"[{args.host}]" if ":" in args.host else args.host
            print(f"minisrv ready: http://{host}:{args.port} model={served} "
                  f"attention_backend={state.info.backend_name} device={state.info.device}", flush=True)
        await serving
        if client.dead:
            _say("error: the engine process died" if args.dp_size == 1 else "error: every engine replica died")
            return 1
        return 0
    finally:
        if not serving.done():
            server.should_exit = True
            await serving
        await client.shutdown()


if __name__ == "__main__":
    main()
