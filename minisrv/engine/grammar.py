"""Structured outputs: a request's JSON schema, JSON-object mode, regex or EBNF grammar becomes a mask over the
vocabulary at every step it samples, so that it can only draw tokens that keep its text inside the grammar. The
engine is xgrammar: a `CompiledGrammar` per grammar and vocabulary, walked by a `GrammarMatcher` per request one
accepted token at a time.

- Compiling takes milliseconds for a small schema and seconds for a large one, so it never runs on the engine
  loop: a small thread pool compiles (xgrammar releases the GIL), and the scheduler admits a request only once the
  engine has seen its compile finish (`GrammarState.ready`). A compile that fails, or misses the compile timeout (a
  grammar too costly to compile), ends its request with "error" naming the request's field (a 400 to an HTTP
  client). A compile past its timeout cannot be stopped: it finishes, and a later request with the same grammar
  gets its result. Results are cached by (kind, text); xgrammar caches too, bounded in bytes.
- The mask is filled on the host, copied to the device from pinned memory without waiting, and applied to the
  logits just before sampling: rows without a grammar pay nothing, and CUDA graphs are untouched (the mask is
  applied to the logits the graph produced). Log-probabilities stay the model's raw distribution, as for penalties.
- Every sampled token is fed to its request's matcher as it is read back, before the engine's finish checks. A
  matcher that accepted a stop token (allowed only where the grammar is complete) ends the request with "stop"; a
  token it rejects (impossible through the mask) ends it with "error". A thinking model's request feeds it only
  the answer's tokens (engine/thinking.py): its thinking is free text, masked only against the stop tokens.
- Overlap scheduling: step N+1's mask needs step N's token accepted, so while a live request has a grammar
  (`Scheduler.num_constrained`) the runner launches steps in two halves (model_runner.py's docstring).

Special tokens other than the stop tokens are never allowed inside a grammar (xgrammar is shown them as empty
strings): their text would be dropped from the output (skip_special_tokens), which would then no longer be what
the grammar matched.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable, TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import torch

from minisrv.tokenizer.engine_tokenizer import transformers_tokenizer
from minisrv.utils import ceil_div, to_device

from .grammar_check import CACHE_ENTRIES, MAX_JSON_WHITESPACE, PARAM, constraint_of, xgrammar_message as _message
from .request import RequestError, SamplingParams

if TYPE_CHECKING:
    from .request import Request

# json_object is any JSON object (OpenAI's JSON mode): the schema {"type": "object"}. xgrammar's builtin JSON
# grammar would also admit a top-level array.
ANY_OBJECT_SCHEMA = '{"type": "object"}'
XGR_CACHE_BYTES = 512 << 20  # xgrammar's own compile cache
COMPILE_WORKERS = 2  # grammars compiled at once (each compile also uses xgrammar's own threads)
BATCH_FILL_MIN = 4  # masks of this many rows or more are filled by one xgrammar call, not a Python loop over rows
# threads of that call: a row of a JSON schema's mask takes less time than handing it to a thread costs (one thread
# beat two on a 2-core machine, and eight were no faster on an H100 host: scripts/bench_grammar_host.py)
BATCH_FILL_THREADS = 1


class GrammarState:
    """One request's grammar: its compile (shared by every request with the same grammar), then its matcher.

    Only the engine loop touches the matcher; the compile future completes in a worker thread, and `ready` is set
    by the loop (`poll`) so the scheduler's view never changes under it."""

    def __init__(self, key: Tuple[str, str], future: "cf.Future", vocab_size: int,
                 batch_filler: Optional[Callable[[], Any]] = None, stop_ids: frozenset = frozenset(),
                 timeout_s: float = math.inf) -> None:
        self.key = key
        self.stop_ids = stop_ids  # a matcher terminates only by accepting one of these
        self.future = future
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s  # not compiled by then: the request is refused
        self.vocab_size = vocab_size  # the model's (the logits' width, and the mask's)
        self.batch_filler = batch_filler  # the engine's xgrammar.BatchGrammarMatcher (fills many rows in one call)
        self.matcher: Any = None
        self.ready = False  # compiled and matched: the request may be admitted
        self.done = False  # it ended (accepted a stop token) or rejected a token: it makes no more masks

    def poll(self) -> Optional[RequestError]:
        """Once the compile is done, make the matcher; returns why the request cannot be served (its compile
        failed, or is past its deadline), else None (not done yet, or ready)."""
        if self.ready:
            return None
        if not self.future.done():
            return too_costly(self.key[0], self.timeout_s) if time.monotonic() > self.deadline else None
        try:
            compiled = self.future.result()
        except Exception as e:  # noqa: BLE001
            return RequestError(f"invalid {self.key[0]}: {_message(e)}", PARAM)
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.ready = True
        return None

    def advance(self, token_id: int) -> bool:
        """Feed a sampled token; True when the grammar has ended (it accepted a stop token). Raises if rejected."""
        if not self.matcher.accept_token(token_id):
            self.done = True
            raise RuntimeError(f"the {self.key[0]} grammar rejected token {token_id}")
        self.done = token_id in self.stop_ids and self.matcher.is_terminated()
        return self.done


class GrammarBackend:
    """Compiles grammars for one tokenizer and model vocabulary, off the caller's thread, with a cache.

    Built once per engine; cheap to build: xgrammar and its view of the vocabulary are set up on first use, in a
    compile worker (a few hundred ms for a 150k vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 compile_timeout_s: float = math.inf) -> None:
        self.tokenizer = tokenizer
        self.compile_timeout_s = compile_timeout_s
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._stop_ids = frozenset(self.stop_token_ids)
        self.num_compiles = 0  # compiles started (cache misses)
        self.cache_hits = 0
        self._cache: "OrderedDict[Tuple[str, str], cf.Future]" = OrderedDict()
        self._lock = threading.Lock()  # the cache and the compiler's creation (check() may run on other threads)
        self._compiler: Any = None
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self._batch_filler: Any = None

    def batch_filler(self) -> Any:
        """xgrammar's BatchGrammarMatcher: fills a step's masks in one call (made on first use)."""
        if self._batch_filler is None:
            import xgrammar as xgr
            self._batch_filler = xgr.BatchGrammarMatcher(max_threads=BATCH_FILL_THREADS)
        return self._batch_filler

    def _get_compiler(self) -> Any:
        """xgrammar's compiler over the model's vocabulary, made on first use."""
        with self._lock:
            if self._compiler is not None:
                return self._compiler
            import xgrammar as xgr
            tok = transformers_tokenizer(self.tokenizer)
            stop = self.stop_token_ids or None
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size, stop_token_ids=stop)
            special = _special_ids(tok) - set(self.stop_token_ids)
            if special:  # the same vocabulary with special tokens blanked: xgrammar then never admits them
                vocab = [""] * self.vocab_size
                for text, i in tok.get_vocab().items():
                    if i < self.vocab_size and i not in special:
                        vocab[i] = text
                info = xgr.TokenizerInfo.from_vocab_and_metadata(vocab, info.dump_metadata())
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
            self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True,
                                                 cache_limit_bytes=XGR_CACHE_BYTES)
            return self._compiler

    def _compile(self, kind: str, text: str) -> Any:
        comp = self._get_compiler()
        if kind in ("json_schema", "json_object"):
            schema = text if kind == "json_schema" else ANY_OBJECT_SCHEMA
            return comp.compile_json_schema(schema, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return comp.compile_regex(text)
        if kind == "ebnf":
            return comp.compile_grammar(text)
        raise ValueError(f"unknown grammar kind {kind!r}")

    def _future(self, key: Tuple[str, str]) -> "cf.Future":
        """The compile of `key`: cached, or started now in a worker."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return fut
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="minisrv-grammar")
            fut = self._pool.submit(self._compile, *key)
            self.num_compiles += 1
            self._cache[key] = fut
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return fut

    def submit(self, params: SamplingParams) -> Optional[GrammarState]:
        """Start (or find) the compile of a request's grammar without waiting for it; None without a grammar."""
        key = constraint_of(params)
        if key is None:
            return None
        return GrammarState(key, self._future(key), self.vocab_size, self.batch_filler, self._stop_ids,
                            self.compile_timeout_s)

    def check(self, params: SamplingParams) -> None:
        """Compile a request's grammar now (through the cache, so the engine's compile of it is then a lookup).
        Raises RequestError(param="response_format") for an invalid one. Blocks the caller: for the offline API,
        or an HTTP handler in a worker thread. (`check_grammar` only parses, and needs no tokenizer.)"""
        key = constraint_of(params)
        if key is None:
            return
        try:
            self._future(key).result(None if math.isinf(self.compile_timeout_s) else self.compile_timeout_s)
        except cf.TimeoutError:
            raise too_costly(key[0], self.compile_timeout_s) from None
        except Exception as e:  # noqa: BLE001
            raise RequestError(f"invalid {key[0]}: {_message(e)}", PARAM) from None


def too_costly(kind: str, timeout_s: float) -> RequestError:
    return RequestError(f"the {kind} grammar did not compile within {timeout_s:g} s: it is too costly to compile; "
                        f"simplify it (fewer alternatives, smaller bounded repeats)", PARAM)


def _special_ids(tokenizer: Any) -> set:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", False))
    return ids



def fill_bitmask(reqs: List["Request"], device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The allowed-token bits of the rows of `reqs` that have a grammar, on `device` (copied without waiting),
    and those rows' indices (None when every row has one). Every grammar row's tokens must be on the host (see the
    overlap note in the module docstring)."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    # filled in pinned memory, which to_device copies from as it is: a 256-row mask of a 150k vocabulary is 4.9 MB,
    # whose staging copy through pageable memory cost the host a large share of a step
    mask = to_device(fill_host_bitmask(reqs, rows, pinned=device.type == "cuda"), torch.int32, device)
    return mask, None if len(rows) == len(reqs) else to_device(rows, torch.int64, device)


def fill_host_bitmask(reqs: List["Request"], rows: List[int], pinned: bool = False) -> torch.Tensor:
    """The masks of reqs[rows] (each with a grammar) in host memory (page-locked if `pinned`), int32
    [len(rows), ceil(V/32)]. A row whose request has finished, or whose grammar is done (the read-back that ended
    it came after this step's forward was queued), allows every token: its token is discarded, and its matcher may
    be terminated, which xgrammar refuses to fill. xgrammar is handed a NumPy view of the memory: through DLPack a
    pinned torch tensor says "CUDA host", which xgrammar may refuse; the same bytes as a NumPy array say "CPU"."""
    first = reqs[rows[0]].grammar
    words = ceil_div(first.vocab_size, 32)
    host = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=pinned)
    view = host.numpy()
    assert not any(reqs[i].num_pending for i in rows), \
        "a grammar row's previous token must be accepted before its mask is made"
    live = [k for k, i in enumerate(rows) if not reqs[i].finished and not reqs[i].grammar.done]
    thinking = [k for k in live if reqs[rows[k]].thinking is not None and not reqs[rows[k]].thinking.answering]
    if thinking:  # their grammars have not started (engine/thinking.py); the matchers fill the other rows
        skip = set(thinking)
        live = [k for k in live if k not in skip]
    if len(live) < len(rows):
        host.fill_(-1)
    if len(live) >= BATCH_FILL_MIN and first.batch_filler is not None:
        first.batch_filler().batch_fill_next_token_bitmask([reqs[rows[k]].grammar.matcher for k in live], view,
                                                           live if len(live) < len(rows) else None)
    else:
        for k in live:
            reqs[rows[k]].grammar.matcher.fill_next_token_bitmask(view, k)
    if thinking:
        _thinking_rows(reqs, rows, thinking, view)
    return host


def _thinking_rows(reqs: List["Request"], rows: List[int], thinking: List[int], view: Any) -> None:
    """The masks of rows whose answer has not begun. Inside the thinking, free text: every token but the stop
    tokens (the model may not end before its answer). Before it (a model that may or may not think), the answer's
    first tokens as the grammar allows them, and the start of a thinking."""
    bits = view.view("uint32")
    for k in thinking:
        state = reqs[rows[k]].thinking
        if state.thinking:
            for t in reqs[rows[k]].grammar.stop_ids:
                bits[k, t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF
        else:
            reqs[rows[k]].grammar.matcher.fill_next_token_bitmask(view, k)
            t = state.rule.start_id
            bits[k, t >> 5] |= 1 << (t & 31)


@functools.lru_cache(maxsize=None)
def _bits(device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=device)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """Logits [B, V] with every token whose bit is 0 in its row's mask set to -inf (a new tensor: the input stays
    the model's raw logits). mask [G, ceil(V/32)] int32, row g for logits row rows[g] (every row when None).

    Bit j of int32 word w is token 32 w + j; read as bytes (little-endian, as on every CUDA device and x86/ARM
    host), that is bit k of byte 4 w + b for token 8 (4 w + b) + k, so the unpacked mask is G x V bytes."""
    assert sys.byteorder == "little", "the bitmask is unpacked as little-endian bytes"
    g, vocab = mask.shape[0], logits.shape[-1]
    banned = (mask.view(torch.uint8).unsqueeze(-1) & _bits(logits.device)).view(g, -1)[:, :vocab] == 0
    if rows is None:
        return logits.masked_fill(banned, float("-inf"))
    return logits.index_put((rows,), logits.index_select(0, rows).masked_fill_(banned, float("-inf")))
