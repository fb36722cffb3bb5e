"""Shared fixtures for the CPU suite: tiny random-weight HF checkpoints, the HF transformers reference (float64),
and an engine watcher that checks the pool's bookkeeping after every step.

Every check compares minisrv against something computed independently of it: HF transformers models run in
float64 (greedy `generate`, teacher-forced logits), HF's logits processors, or hand computations.
"""
from __future__ import annotations

import json
import os
import random
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from minisrv import LLM, SamplingParams  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# tiny checkpoints

NUM_SPECIAL = 3  # <pad>=0, <bos>=1, <eos>=2; every other id i is the word "t{i}"
EOS_ID = 2

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}

# name -> (transformers config class name, config kwargs). Shapes: hidden 64, 4 heads / 2 kv heads, head_dim 16.
TINY_SPECS: Dict[str, Tuple[str, dict]] = {
    # llama3 rope scaling, untied lm_head
    "llama": ("LlamaConfig", dict(vocab_size=384, num_hidden_layers=2, max_position_embeddings=512,
                                  rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)),
    # qkv bias (Qwen2's default), tied embeddings
    "qwen2": ("Qwen2Config", dict(vocab_size=320, num_hidden_layers=2, max_position_embeddings=256,
                                  tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1000000.0})),
    # q/k RMSNorm, tied embeddings, 3 layers
    "qwen3": ("Qwen3Config", dict(vocab_size=448, num_hidden_layers=3, max_position_embeddings=256,
                                  tie_word_embeddings=True)),
    # Mistral (its default sliding window, 4096, is wider than the context), untied
    "mistral": ("MistralConfig", dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)),
}
ARCHS = list(TINY_SPECS)

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)


def make_config(name: str, **overrides):
    import transformers
    cls_name, kw = TINY_SPECS[name]
    kw = {**COMMON, **kw, **overrides}
    return getattr(transformers, cls_name)(**kw)


def init_weights(model: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    """Weights large enough that greedy choices are rarely near-ties; norms and biases randomised too, so the
    tests notice if one of them is dropped or applied to the wrong tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * (torch.rand(p.shape, generator=g) - 0.5))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer: ids 0-2 are <pad>/<bos>/<eos>, id i >= 3 is the word "t{i}". Decoding concatenates
    the words ("t12t7"), so a decoded text is exactly the concatenation of its tokens' strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    vocab.update({f"t{i}": i for i in range(NUM_SPECIAL, vocab_size)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)


def build_tiny_model(path: str, name: str, seed: int = 0, **config_overrides) -> str:
    """Save a random-weight HF checkpoint (config.json + model.safetensors + tokenizer) into `path`."""
    import transformers
    cfg = make_config(name, **config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, type(cfg).__name__.replace("Config", "ForCausalLM"))(cfg)
    init_weights(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg.vocab_size)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(name) -> directory of a saved tiny checkpoint (built once per session)."""
    cache: Dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            path = str(tmp_path_factory.mktemp(f"tiny-{name}"))
            cache[name] = build_tiny_model(path, name, seed=ARCHS.index(name) + 1)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_qwen2_tools(tmp_path_factory) -> str:
    """Directory of a tiny random-weight Qwen2 with a Qwen2.5-style tool-calling chat template (tiny_qwen2.py)."""
    from .tiny_qwen2 import build_tiny_qwen2
    return build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2-tools")))


def vocab_of(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


PROMPT_LENS = [5, 40, 3, 23, 12, 31]


def make_prompts(vocab: int, lens: Sequence[int] = PROMPT_LENS, seed: int = 1234) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(NUM_SPECIAL, vocab) for _ in range(n)] for n in lens]


def make_llm(path: Optional[str], **kw) -> LLM:
    """A CPU engine on the torch backend; the prefix cache is off unless asked for (tests/test_prefix_cache.py
    runs the same checks with it on), so page accounting stays that of the requests alone."""
    opts = dict(attention_backend="torch", dtype="float32", log_level="warning", max_total_tokens=4096,
                disable_radix_cache=True)
    opts.update(kw)
    return LLM(model=path, **opts)


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---------------------------------------------------------------------------------------------------------------
# the HF reference, in float64


@lru_cache(maxsize=None)
def hf_model(path: str, dtype: torch.dtype = torch.float64):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return m.eval()


@lru_cache(maxsize=None)
def _hf_generate(path: str, prompt: Tuple[int, ...], n: int, extra: Tuple[Tuple[str, float], ...]):
    m = hf_model(path)
    ids = torch.tensor([list(prompt)])
    # eos_token_id=None: the engine runs with ignore_eos, so HF must neither stop at eos nor (min_new_tokens)
    # mask it out of the argmax; passing it as an argument overrides the saved generation_config
    with torch.no_grad():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                         output_logits=True, output_scores=True, **dict(extra))
    tokens = out.sequences[0, len(prompt):].tolist()
    scores = torch.stack([s[0] for s in out.scores])  # after HF's logits processors (what it chose from)
    assert len(tokens) == n
    # the reference itself: its greedy choice is the argmax of what its processors left
    assert tokens == scores.argmax(-1).tolist()
    return tokens, scores


def hf_greedy(path: str, prompt: Sequence[int], n: int, **extra) -> Tuple[List[int], torch.Tensor]:
    """HF `generate(do_sample=False)` on one prompt alone (no padding): (tokens, the [n, V] scores it chose from)."""
    return _hf_generate(path, tuple(prompt), n, tuple(sorted(extra.items())))


def hf_logits(path: str, ids: Sequence[int]) -> torch.Tensor:
    """Float64 logits [T, V] of a full causal forward over ids (teacher forcing). Cached: do not modify."""
    return _hf_logits(path, tuple(ids))


@lru_cache(maxsize=512)
def _hf_logits(path: str, ids: Tuple[int, ...]) -> torch.Tensor:
    m = hf_model(path)
    with torch.no_grad():
        return m(torch.tensor([list(ids)])).logits[0]


TIE = 1e-4  # top-2 gap (in logits) below which two tokens count as tied


def assert_greedy_matches(ours: Sequence[int], ref: Sequence[int], ref_scores: torch.Tensor, what: str = "") -> None:
    """Tokens equal, or equal up to a position where HF's top-2 are tied and ours picked one of the tied tokens
    (after which the continuations legitimately differ)."""
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens, HF made {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        top2 = ref_scores[i].topk(2)
        gap = (top2.values[0] - top2.values[1]).item()
        tied = gap < TIE and a in top2.indices.tolist()
        assert tied, (f"{what}: token {i} differs: ours {a}, HF {b} (HF top-2 gap {gap:.3g}, not a tie)\n"
                      f"ours {list(ours)}\nHF   {list(ref)}")
        return


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return (torch.linalg.vector_norm(ours.double() - ref) / torch.linalg.vector_norm(ref)).item()


# ---------------------------------------------------------------------------------------------------------------
# engine watcher


class EngineWatch:
    """Wraps an engine's step (and its allocator) to check, after every step, that pages and table rows are
    accounted for exactly once, and records every logits row the runner computes for a sampling request."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps = 0
        self.outstanding: set = set()  # pages handed out and not yet returned to the free stack
        self.logits: Dict[str, List[Tuple[int, torch.Tensor]]] = {}  # rid -> [(position, logits row)]
        self.modes: List[str] = []
        self.partial_extends = 0  # extend rows that stopped short of the end of their sequence (chunked prefill)
        self.reqs: Dict[str, object] = {}  # every request seen in a batch
        self._batch = None
        alloc = engine.allocator
        self.outstanding = {p for p in range(alloc.num_pages) if alloc.refcount(p) > 0}
        orig_alloc, orig_free = alloc.alloc, alloc.free

        def checked_alloc(n):
            pages = orig_alloc(n)
            assert len(set(pages)) == len(pages), f"alloc returned a page twice: {pages}"
            again = self.outstanding.intersection(pages)
            assert not again, f"pages {sorted(again)} handed out while still in use"
            self.outstanding.update(pages)
            return pages

        def checked_free(pages):
            orig_free(pages)
            for p in pages:
                if alloc.refcount(p) == 0:
                    self.outstanding.discard(p)

        alloc.alloc, alloc.free = checked_alloc, checked_free

        runner = engine.runner
        orig_step, orig_fwd = runner.launch, runner.forward_logits

        def runner_step(sb, *args, **kwargs):
            self._batch = sb
            self._check_batch(sb)
            return orig_step(sb, *args, **kwargs)

        def forward_logits(fb):
            out = orig_fwd(fb)
            sb = self._batch
            if sb is not None:
                for i, (r, n) in enumerate(zip(sb.reqs, sb.extend_lens)):
                    self.logits.setdefault(r.rid, []).append((r.num_cached + n - 1, out[i].detach().clone()))
            return out

        runner.launch = runner_step
        runner.forward_logits = forward_logits
        orig_engine_step = engine.step

        def engine_step():
            outs = orig_engine_step()
            self.steps += 1
            self.check()
            return outs

        engine.step = engine_step

    def _check_batch(self, sb) -> None:
        ps = self.engine.pool.page_size
        self.modes.append(sb.mode.value)
        self.partial_extends += sum(1 for s in sb.samples if not s)
        for r in sb.reqs:
            self.reqs[r.rid] = r
        loc = sb.out_cache_loc.tolist()
        assert len(loc) == sum(sb.extend_lens) and len(set(loc)) == len(loc), "a slot written twice in one step"
        i = 0
        for r, n in zip(sb.reqs, sb.extend_lens):
            mine = loc[i:i + n]
            i += n
            owned = set(r.pages)
            assert all(s // ps in owned for s in mine), f"{r.rid} writes slots outside its own pages"
            expect = [r.pages[p // ps] * ps + p % ps for p in range(r.num_cached, r.num_cached + n)]
            assert mine == expect, f"{r.rid}: slots {mine} are not its positions' slots {expect}"

    def check(self) -> None:
        eng = self.engine
        sched, alloc, table = eng.scheduler, eng.allocator, eng.table
        ps = eng.pool.page_size
        owned: Dict[int, str] = {}
        holders: Dict[int, int] = {}  # page -> requests holding it (a cached prefix is shared)
        tree = tree_pages(eng)
        rows = set()
        free_rows = set(table._free_rows)
        for r in sched.running:
            assert r.status.value == "running"
            assert r.row >= 0 and r.row not in rows and r.row not in free_rows and r.row != eng.pad_row, \
                f"{r.rid} has a bad or shared table row {r.row}"
            rows.add(r.row)
            assert len(r.pages) == -(-r.num_cached // ps), \
                f"{r.rid}: {len(r.pages)} pages for {r.num_cached} cached tokens"
            for i, p in enumerate(r.pages):
                if p in owned:  # only a prefix from the cache is shared, and it is read-only: whole pages
                    assert p in tree and (i + 1) * ps <= r.num_cached, f"page {p} of {owned[p]} and {r.rid}"
                owned[p] = r.rid
                holders[p] = holders.get(p, 0) + 1
            if r.num_cached:
                slots = [r.pages[q // ps] * ps + q % ps for q in range(r.num_cached)]
                assert table.table[r.row, :r.num_cached].tolist() == slots, f"{r.rid}: table row disagrees"
        for r in sched.waiting:
            assert r.status.value == "waiting" and not r.pages and r.row == -1 and r.num_cached == 0
        for p in set(owned) | tree:
            want = holders.get(p, 0) + (p in tree)
            assert alloc.refcount(p) == want, f"page {p} has refcount {alloc.refcount(p)}, held {want} times"
        used = set(owned) | tree
        free = alloc._free
        assert len(set(free)) == len(free), "a page is on the free stack twice"
        assert not set(free) & used, "a page is both free and in use"
        assert len(free) + len(used) == alloc.num_pages, \
            f"{alloc.num_pages - len(free) - len(used)} pages are neither free nor in use (leak)"
        assert self.outstanding == used, "allocator and requests disagree about which pages are in use"
        assert len(free_rows) + len(rows) + 1 == table.table.shape[0], "a table row leaked"

    def assert_idle(self) -> None:
        eng = self.engine
        assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.scheduler.by_id
        assert_pool_free(eng)

    def errors_against(self, model) -> List[float]:
        """Relative error of every recorded logits row against `model`'s (an HF model's) teacher-forced logits."""
        errs = []
        for req in self.reqs.values():
            seq = req.prompt_ids + req.output_ids
            with torch.no_grad():
                ref = model(torch.tensor([seq[:-1] if req.output_ids else seq])).logits[0]
            errs += [rel_err(row, ref[pos]) for pos, row in self.logits.get(req.rid, [])]
        return errs

    def check_logits(self, path: str, reqs=None, tol: float = 1e-4) -> int:
        """Every recorded logits row (one per step per request) against HF's teacher-forced float64 logits at the
        same position of the same sequence. Returns how many rows were compared."""
        count = 0
        for req in (self.reqs.values() if reqs is None else reqs):
            rows = self.logits.get(req.rid, [])
            seq = req.prompt_ids + req.output_ids
            ref = hf_logits(path, seq[:-1] if req.output_ids else seq)
            for pos, row in rows:
                err = rel_err(row, ref[pos])
                assert err < tol, f"{req.rid}: logits at position {pos} off by {err:.2e} (relative)"
                count += 1
        return count


def tree_pages(engine) -> set:
    """Pages the prefix cache holds (walked independently of its counters)."""
    cache = engine.cache
    if cache is None:
        return set()
    pages, todo = set(), [cache.root]
    while todo:
        n = todo.pop()
        pages.update(n.pages)
        todo.extend(n.children.values())
    return pages


def assert_pool_free(engine) -> None:
    """No request holds a page: every page is free or held once by the prefix cache, which holds no lock."""
    tree = tree_pages(engine)
    alloc = engine.allocator
    assert engine.cache is None or engine.cache.root.lock_ref == 0, "a prefix-cache path is still locked"
    assert all(alloc.refcount(p) == 1 for p in tree), "a cached page is still held by a request"
    assert engine.allocator.num_free + len(tree) == engine.allocator.num_pages, \
        f"{engine.allocator.num_pages - engine.allocator.num_free - len(tree)} pages still in use"
    assert engine.table.num_free_rows == engine.table.table.shape[0] - 1, "table rows still in use"

