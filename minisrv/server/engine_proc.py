"""The engine in its own process, and the asyncio handle the HTTP side uses to talk to it.

Why a process: a model step holds the CPU/GPU for milliseconds to seconds, and under the GIL it would stall the
event loop (and the event loop would delay steps). Two ZeroMQ PUSH/PULL pipes over ipc:// carry messages.py's typed
messages, pickled; sends never block (unbounded high-water marks), so neither loop waits on the other. The engine
makes each request's text; this side only routes outputs (or a refusal, as its RequestError) to the waiting HTTP
request. A FlushCache is handled in the order sent: after an AddRequest it is refused (that request is queued),
after the AbortRequest of the last running request it succeeds."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import zmq

from minisrv.config import EngineConfig
from minisrv.engine.request import RequestError, RequestOutput, SamplingParams

from .messages import (AbortRequest, AddRequest, CacheFlushed, EngineInfo, EngineReady, EngineStats, FlushCache,
                       Rejected, Shutdown, StartupFailed, StatsQuery, StepOutputs, ToEngine)

logger = logging.getLogger("minisrv.server")

FLUSH_TIMEOUT_S = 60.0  # an engine that has not answered a FlushCache by then is reported unavailable
STATS_INTERVAL_S = 0.1  # while busy, at most this often; always at once when the engine goes idle
IDLE_POLL_MS = 1000  # an idle engine wakes this often to check that its parent is alive
RECV_BATCH = 64  # the most engine messages routed in one go


class EngineDead(RuntimeError):
    """The engine process is gone."""


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A socket of the pipe between the server and its engine, either end: no high-water mark (a message is never
    dropped or held back), and closing it never waits for undelivered messages."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    return s


def engine_main(cfg: EngineConfig, in_addr: str, out_addr: str, parent_pid: int, staged: bool = True) -> None:
    """Entry point of the engine process (spawned): load, report ready or the error, then loop. staged: report
    ready before FlashInfer's kernels are built and the CUDA graphs captured (a server's first answer does not wait
    for them); else only once everything is (an offline job's throughput wants no switch mid-run)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    ctx = zmq.Context()
    recv, send = _socket(ctx, zmq.PULL), _socket(ctx, zmq.PUSH)
    recv.connect(in_addr)
    send.connect(out_addr)
    try:
        from minisrv.engine.engine import Engine
        engine = Engine(cfg, staged_kernels=staged)
    except BaseException as e:  # noqa: BLE001 - every startup failure must reach the launcher
        logger.debug("engine startup failed", exc_info=True)
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        send.send_pyobj(StartupFailed(detail))
        time.sleep(0.2)  # let the message leave before the process ends
        ctx.destroy(linger=1000)
        os._exit(1)
    # from here on a SIGTERM lets a first start's GGUF cache write finish (seconds) before the process ends
    signal.signal(signal.SIGTERM, lambda *_: (engine.finish_cache_write(), os._exit(0)))
    send.send_pyobj(EngineReady(EngineInfo.from_engine(engine)))
    code = 0
    try:
        from minisrv.utils import freeze_startup_heap
        # start-up ends once the built kernels serve: what their switch dropped is collected then, and the rest
        # kept out of later collections' walk
        _loop(engine, recv, send, parent_pid, on_started=freeze_startup_heap)
    except BaseException:  # noqa: BLE001 - e.g. a lost tensor-parallel rank: logged, and the process ends
        logger.exception("engine: the loop ended")
        code = 1
    finally:
        engine.close()
        ctx.destroy(linger=0)
        engine.finish_cache_write()
    os._exit(code)


def _loop(engine: Any, recv: zmq.Socket, send: zmq.Socket, parent_pid: int,
          on_started: Optional[Callable[[], None]] = None) -> None:
    """Serve messages until Shutdown; on_started is called once the kernels built at start-up all serve."""
    last_stats: Optional[Dict[str, Any]] = None
    last_sent = 0.0
    while True:
        if on_started is not None and engine.staged_kernels is None:
            on_started()
            on_started = None
        busy = engine.has_work()
        msgs: List[ToEngine] = []
        if recv.poll(0 if busy else IDLE_POLL_MS):
            with contextlib.suppress(zmq.Again):  # until nothing is left
                while True:
                    msgs.append(recv.recv_pyobj(zmq.NOBLOCK))
        if os.getppid() != parent_pid:
            logger.warning("engine: parent process is gone; exiting")
            return
        outputs: List[RequestOutput] = []
        stats_asked = False
        for msg in msgs:
            match msg:
                case AddRequest(rid, prompt_ids, params):
                    try:
                        engine.add(engine.make_request(prompt_ids, params, rid))
                    except RequestError as e:
                        send.send_pyobj(Rejected(rid, str(e), e.param, e.code))
                case AbortRequest(rid):
                    out = engine.abort(rid)
                    if out is not None:
                        outputs.append(out)
                case StatsQuery():
                    stats_asked = True
                case FlushCache(token):
                    ok = engine.flush_cache()
                    logger.info("engine: prefix cache %s", "flushed" if ok else "not flushed (requests pending)")
                    send.send_pyobj(CacheFlushed(token, ok))
                case Shutdown():
                    return
                case _:
                    logger.error("engine: unknown message %r ignored", msg)
        if engine.staged_kernels is not None:  # kernels built since the start: switched to between two steps
            outputs.extend(engine.switch_kernels(idle=not busy and not msgs))  # idle: a poll's wait with nothing to do
        if engine.has_work():
            outputs.extend(engine.step())
        if outputs:
            send.send_pyobj(StepOutputs(outputs))
        stats = engine.stats()
        now = time.monotonic()
        if stats_asked or (stats != last_stats and (now - last_sent >= STATS_INTERVAL_S or not engine.has_work())):
            send.send_pyobj(EngineStats(stats))
            last_stats, last_sent = stats, now


class Sink:
    """Where an HTTP request's engine requests deliver: put_nowait((tag, RequestOutput | RequestError | EngineDead)),
    read by one task a wake-up at a time (take). Unlike an asyncio.Queue it wakes its reader once for everything put
    meanwhile, and keeps no per-item bookkeeping: a stream receives an item every engine step."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: List[Tuple[Any, Any]] = []
        self.waiter: Optional[asyncio.Future] = None

    def put_nowait(self, item: Tuple[Any, Any]) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> List[Tuple[Any, Any]]:
        """Everything put since the last take, waiting for the first if there is none yet."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


class EngineClient:
    """Owns the engine process; routes its outputs to per-HTTP-request queues. Use from one event loop."""

    def __init__(self, cfg: EngineConfig, staged: bool = True) -> None:
        self.cfg, self.staged = cfg, staged  # staged: see engine_main
        self.stats: Dict[str, Any] = {}
        self.ready = self.dead = False
        self.on_death: Optional[Callable[[], None]] = None
        self._routes: Dict[str, Tuple[Sink, Any]] = {}
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._stats_event = asyncio.Event()
        self._flushes: Dict[int, asyncio.Future] = {}  # FlushCache token -> its answer
        self._next_flush = 0
        self._tasks: List[asyncio.Task] = []
        self._dir = tempfile.mkdtemp(prefix="minisrv-")
        self._ctx: Optional[Any] = None
        self._proc: Optional[Any] = None

    async def start(self) -> EngineInfo:
        """Spawn the engine and wait until it has loaded; raises RuntimeError with the engine's reason."""
        import zmq.asyncio
        self._ctx = zmq.asyncio.Context()
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._send, self._recv = _socket(self._ctx, zmq.PUSH), _socket(self._ctx, zmq.PULL)
        self._send.bind(in_addr)
        self._recv.bind(out_addr)
        self._proc = mp.get_context("spawn").Process(
            target=engine_main, args=(self.cfg, in_addr, out_addr, os.getpid(), self.staged), name="minisrv-engine",
            daemon=self.cfg.tp_size == 1)  # a daemon cannot start tensor-parallel ranks; it is reaped in shutdown
        self._proc.start()
        while True:
            if await self._recv.poll(200):
                msg = await self._recv.recv_pyobj()
                if isinstance(msg, EngineReady):
                    break
                if isinstance(msg, StartupFailed):
                    await self._reap()
                    raise RuntimeError(msg.detail)
            elif not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited during startup (exit code {self._proc.exitcode})")
        self.ready = True
        self._tasks = [asyncio.create_task(self._recv_loop(), name="engine-recv"),
                       asyncio.create_task(self._send_loop(), name="engine-send"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog")]
        return msg.info

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the engine to stop, then terminate/kill it if it does not; always reaps it (no zombie)."""
        looping = self.ready  # still loading: it reads no messages, so it is terminated at once
        self.ready = False
        for t in self._tasks:
            t.cancel()
        if looping and self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(Exception):  # the process is stopped below anyway
                await asyncio.wait_for(self._send.send_pyobj(Shutdown()), 1.0)
        await self._reap(timeout if looping else 0.0)
        self._fail_all(EngineDead("the server is shutting down"))
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _reap(self, timeout: float = 5.0) -> None:
        p = self._proc
        if p is None or p.pid is None:  # (never started: spawning it failed)
            return
        deadline = time.monotonic() + timeout
        while p.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if p.is_alive():
            p.terminate()
            await asyncio.sleep(0)
            p.join(2)
        if p.is_alive():
            p.kill()
        p.join()

    @property
    def load(self) -> int:
        """Requests of this server the engine holds (queued or running): what it reports, without asking it."""
        return len(self._routes)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def submit(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, tag: Any) -> None:
        """Queue a request; its outputs arrive in `sink` as (tag, RequestOutput), the engine's refusal as
        (tag, RequestError), the engine's death as (tag, EngineDead). The route is forgotten once it finishes."""
        if self.dead or not self.ready:
            raise EngineDead("the engine is not running")
        self._routes[rid] = (sink, tag)
        self._outbox.put_nowait(AddRequest(rid, list(prompt_ids), params))

    def abort(self, rid: str) -> None:
        """Forget a request and tell the engine to drop it (frees its KV pages). Never blocks, never awaits."""
        if self._routes.pop(rid, None) is not None and not self.dead:
            self._outbox.put_nowait(AbortRequest(rid))

    async def fresh_stats(self, timeout: float = 0.5) -> Dict[str, Any]:
        """Ask for stats now; returns the last known ones if the engine is mid-step for longer than timeout."""
        if self.ready and not self.dead:
            self._stats_event.clear()
            self._outbox.put_nowait(StatsQuery())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stats_event.wait(), timeout)
        return self.stats

    async def flush_cache(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Empty the engine's prefix cache; False (nothing done) while requests are queued or running. Raises
        EngineDead if the engine is not running, dies meanwhile or does not answer within `timeout` seconds."""
        if self.dead or not self.ready:
            raise EngineDead("the engine is not running")
        if self._routes:  # requests of this server are pending: no need to ask (or to wait for a long step)
            return False
        self._next_flush += 1
        token = self._next_flush
        answer = asyncio.get_running_loop().create_future()
        self._flushes[token] = answer
        self._outbox.put_nowait(FlushCache(token))
        try:
            return await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            raise EngineDead(f"the engine did not answer a cache flush within {timeout:g} s") from None
        finally:
            self._flushes.pop(token, None)

    async def _send_loop(self) -> None:
        while True:
            await self._send.send_pyobj(await self._outbox.get())

    async def _recv_loop(self) -> None:
        while True:
            # what else has arrived is routed too before any request reads its outputs: when this side falls behind
            # the engine, a request gets several steps' outputs in one wake-up (a stream writes them at once)
            raws = [await self._recv.recv()]
            while len(raws) < RECV_BATCH:
                more = self._recv.recv(zmq.NOBLOCK)  # answered at once: a message, or zmq.Again
                if more.exception() is not None:
                    break
                raws.append(more.result())
            for raw in raws:
                self._route(pickle.loads(raw))

    def _route(self, msg: Any) -> None:
        match msg:
            case StepOutputs(outputs):
                for out in outputs:
                    route = self._routes.get(out.rid)
                    if route is not None:
                        if out.finished:
                            del self._routes[out.rid]
                        route[0].put_nowait((route[1], out))
            case EngineStats(stats):
                self.stats = stats
                self._stats_event.set()
            case CacheFlushed(token, ok):
                answer = self._flushes.get(token)
                if answer is not None and not answer.done():
                    answer.set_result(ok)
            case Rejected(rid, message, param, code):
                route = self._routes.pop(rid, None)
                if route is not None:
                    route[0].put_nowait((route[1], RequestError(message, param, code)))
            case _:
                logger.error("unknown message from the engine %r ignored", msg)

    async def _watchdog(self) -> None:
        while self._proc is not None and self._proc.is_alive():
            await asyncio.sleep(0.5)
        if not self.ready:
            return
        self.dead, self.ready = True, False
        logger.error("the engine process died (exit code %s)", self._proc.exitcode if self._proc else None)
        self._fail_all(EngineDead("the engine process died"))
        if self.on_death is not None:
            self.on_death()

    def _fail_all(self, err: Exception) -> None:
        routes, self._routes = self._routes, {}
        for sink, tag in routes.values():
            sink.put_nowait((tag, err))
        flushes, self._flushes = self._flushes, {}
        for answer in flushes.values():
            if not answer.done():
                answer.set_exception(err)
