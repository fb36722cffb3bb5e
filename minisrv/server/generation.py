"""The one request path of every generation endpoint (completions, chat, Responses, Messages), from planned prompts
to the HTTP response.

Each endpoint hands over a `Generation` (prompt ids, SamplingParams, n, echoed prompt text) and a `Renderer` (its
response shapes); everything else happens here, once: one engine request (`Job`) per choice of each prompt, the
seeds of n > 1 choices, streaming or collecting outputs into `Choice`s, usage, metrics, aborting what is left when
the client goes away, and a refusal or failure of the engine as an APIError (an HTTP error until a stream begins,
at the request's first output; an error event after)."""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Protocol, Sequence, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisrv.engine.request import RequestError, RequestOutput, SamplingParams

from .engine_proc import EngineDead, Sink
from .errors import APIError, engine_unavailable, from_request_error, request_failed, server_shutdown
from .metrics import TokenClock
from .openai.logprobs import PositionedLogprob
from .openai.protocol import PromptTokensDetails, UsageInfo
from .streaming import EventStream, unless_disconnected

if TYPE_CHECKING:
    from .state import ServerState


STOP = object()  # the tag of the item ServerState.stop puts in a sink


@dataclass
class Generation:
    """What an endpoint asks for: n choices of each prompt."""

    prompts: List[List[int]]
    params: SamplingParams
    n: int = 1
    prefixes: Sequence[str] = ()  # per prompt: text its choices start with (completions' echo), or none


@dataclass
class Job:
    index: int  # the choice's index in the response: prompt * n + choice
    rid: str
    prompt_ids: List[int]
    params: SamplingParams


@dataclass
class Choice:
    index: int
    prefix: str = ""  # sent before the first token (echoed prompt text); offsets count it
    prompt_ids: List[int] = field(default_factory=list)
    text: str = ""  # generated text (without the prefix)
    token_ids: List[int] = field(default_factory=list)  # generated tokens (a harmony output is read from them)
    logprobs: List[PositionedLogprob] = field(default_factory=list)
    prompt_logprobs: Optional[List[Any]] = None  # TokenLogprob per prompt token (the first None), when asked for
    finish_reason: Optional[str] = None
    stop_str: Optional[str] = None  # the stop string that ended it, if one did
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache
    opened: bool = False  # whether a stream has started this choice

    def feed(self, out: RequestOutput) -> Tuple[str, List[PositionedLogprob]]:
        """Take one output; returns its text delta and its tokens' logprobs with their offsets."""
        lps = out.new_logprobs
        if out.finish_reason == "stop" and out.stop_str is None and out.new_token_ids:
            lps = lps[:len(out.new_token_ids) - 1]  # the EOS / stop token that ended it has no text
        base = len(self.prefix)
        new = [(lp, base + offset) for lp, offset in zip(lps, out.text_offsets)]
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += new
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.stop_str = out.finish_reason, out.stop_str
        return out.new_text, new


class Renderer(Protocol):
    """An endpoint's response shapes. A stream's events come framed (SSE text): `opening` per choice before any token,
`chunks` per output with text, logprobs or an end, then `closing` or `failed` (after it began). `response` is a
non-streaming request's whole answer (a pydantic model or a JSON-able dict)."""

    id: str  # the response id ("cmpl-...", "chatcmpl-...", ...); engine request ids derive from it

    def opening(self, choice: Choice) -> List[str]: ...
    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[str]: ...
    def closing(self, usage: UsageInfo) -> List[str]: ...
    def failed(self, error: APIError) -> List[str]: ...
    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Any: ...


async def serve(state: "ServerState", request: Request, gen: Generation, renderer: Renderer, stream: bool) -> Response:
    """Run a generation through the engine and answer it, streamed (SSE) or whole."""
    jobs = make_jobs(renderer.id, gen)
    choices = [Choice(j.index, gen.prefixes[j.index // gen.n] if gen.prefixes else "", j.prompt_ids) for j in jobs]

    def usage() -> UsageInfo:
        p = sum(len(ids) for ids in gen.prompts)  # each prompt once, whatever n
        c = sum(ch.num_output_tokens for ch in choices)
        cached = sum(ch.num_cached_tokens for ch in choices[::gen.n])  # each prompt's first choice
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    if stream:
        # The stream opens with the engine's first output of the request (its first token anyway): a request the
        # engine refuses before it generates anything (a grammar that fails to compile or outlasts its compile
        # timeout) is answered with its HTTP error, as it is unstreamed, instead of a stream that only fails.
        steps = run_jobs(state, jobs)
        first = await unless_disconnected(request, anext(steps, None))

        async def events() -> AsyncIterator[str]:
            """The renderer's events, each engine step's written at once. Closing this closes run_jobs, which aborts
            the engine requests left."""
            async with contextlib.aclosing(steps):
                yield "".join(e for ch in choices for e in renderer.opening(ch))
                try:
                    step = first
                    while step is not None:
                        written: List[str] = []
                        for index, out in step:
                            ch = choices[index]
                            text, lps = ch.feed(out)
                            finish = out.finish_reason if out.finished else None
                            if text or lps or finish:
                                written += renderer.chunks(ch, text, lps, finish)
                        yield "".join(written)
                        step = await anext(steps, None)
                except APIError as err:
                    yield "".join(renderer.failed(err))
                    return
                yield "".join(renderer.closing(usage()))

        return EventStream(events(), closes=steps)

    async def collect() -> None:
        async with contextlib.aclosing(run_jobs(state, jobs)) as steps:
            async for step in steps:
                for index, out in step:
                    choices[index].feed(out)

    await unless_disconnected(request, collect())
    body = renderer.response(choices, usage())
    if isinstance(body, dict):
        return JSONResponse(body)
    return Response(body.model_dump_json(), media_type="application/json")


def make_jobs(prefix: str, gen: Generation) -> List[Job]:
    """One job per choice of each prompt. With a seed and n > 1, choice j samples with seed + j (wrapping in 64
    bits): choices differ yet are reproducible (the other values are not validated again per choice)."""
    p = gen.params
    per_choice = [p if p.seed is None or j == 0 else p.with_seed((p.seed + j + 2 ** 63) % 2 ** 64 - 2 ** 63)
                  for j in range(gen.n)]
    return [Job(i, f"{prefix}-{i}", ids, per_choice[i % gen.n])
            for i, ids in enumerate(ids for ids in gen.prompts for _ in range(gen.n))]


async def run_jobs(state: "ServerState", jobs: List[Job]) -> AsyncIterator[List[Tuple[int, RequestOutput]]]:
    """Submit all jobs; yield each engine step's outputs as (choice index, output) until all have finished. A refusal,
the engine's death, a failed request or the server's stop raises an APIError; on exit (done, failed, or closed: the
client went away) what is left is aborted, without awaiting anything."""
    client, m = state.client, state.metrics
    sink = Sink()
    pending: Dict[int, TokenClock] = {}
    on_stop = functools.partial(sink.put_nowait, (STOP, None))
    if state.stopping:
        raise server_shutdown()
    state.on_stop.add(on_stop)
    try:
        for j in jobs:
            client.submit(j.rid, j.prompt_ids, j.params, sink, j.index)
            pending[j.index] = TokenClock(time.perf_counter())
            m.prompt_tokens.inc(len(j.prompt_ids))
        while pending:
            items = await sink.take()
            t = time.perf_counter()
            step: List[Tuple[int, RequestOutput]] = []
            for index, item in items:
                failure: Optional[Exception] = None
                if index is STOP:
                    failure = server_shutdown()
                elif isinstance(item, Exception):  # refused by the engine, or the engine is gone
                    pending.pop(index, None)
                    m.dropped("error")
                    failure = item
                else:
                    clock = pending[index]
                    m.tokens(clock, len(item.new_token_ids), t)
                    if item.finished:
                        del pending[index]
                        m.ended(item.finish_reason or "unknown", clock, t)
                        if item.finish_reason == "error":  # the request's own fault (a 400), or the engine's
                            failure = RequestError(item.error, item.error_param) if item.error_param else \
                                request_failed(item.error)
                if failure is not None:
                    if step:  # what arrived before the failure (in the same wake-up) is delivered first
                        yield step
                    raise failure
                step.append((index, item))
            yield step
    except RequestError as e:
        raise from_request_error(e) from None
    except EngineDead as e:
        raise engine_unavailable(str(e)) from None
    finally:
        state.on_stop.discard(on_stop)
        for index in pending:
            client.abort(jobs[index].rid)
            m.dropped("abort")
