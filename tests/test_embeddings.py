"""Embedding models: LLM.embed and POST /v1/embeddings against HF transformers in float64 on the same weights (the
last hidden state of `AutoModel`, pooled and normalised by hand as sentence-transformers would), through batching,
chunked prefill and the prefix cache; the detection of an embedding checkpoint; the endpoint's shapes and 400s, in
process on the real engine and (slow) through a server process with the openai client.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
from typing import Any, Dict, List, Sequence

import numpy as np
import pytest
import torch

from minisrv.engine.pooling import PoolingParams
from minisrv.engine.request import RequestError, SamplingParams
from minisrv.models.args import ModelArgs
from minisrv.checkpoints.checkpoint import WeightLoadError
from minisrv.checkpoints.pooling_config import resolve_pooling
from minisrv.server.messages import EngineInfo
from minisrv.server.app import create_app
from minisrv.server.state import ServerState

from .helpers.engine_watch import EngineWatch, assert_pool_free
from .helpers.tiny_models import init_weights, make_config, make_llm, make_prompts, write_tokenizer

httpx = pytest.importorskip("httpx")

TOL = 1e-4  # relative, against HF in float64 (float32 here)
LENS = [5, 40, 3, 23, 12, 31, 8]


def _write_st(path: str, mode: str, normalize: bool) -> None:
    """sentence-transformers' files: modules.json and the Pooling module's config."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    flags = {k: False for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                                "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                                "pooling_mode_lasttoken")}
    flags[mode] = True
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **flags, "include_prompt": True}, f)


def build_embedding_model(path: str, kind: str, seed: int = 7) -> str:
    """A tiny random Qwen3 embedding checkpoint. kind "base": a bare `Qwen3Model` (tensor names without "model.",
    no sentence-transformers files: detected from the architecture); "st_mean" / "st_last": a Qwen3ForCausalLM
    checkpoint (lm_head untied, so the loader must skip it) with sentence-transformers mean pooling without
    Normalize, or last-token pooling with it."""
    import transformers
    cfg = make_config("qwen3", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(cfg) if kind == "base" else transformers.Qwen3ForCausalLM(cfg)
    init_weights(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg.vocab_size)
    if kind != "base":
        _write_st(path, "pooling_mode_mean_tokens" if kind == "st_mean" else "pooling_mode_lasttoken",
                  kind == "st_last")
    return path


@pytest.fixture(scope="module")
def emb_model(tmp_path_factory):
    cache: Dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = build_embedding_model(str(tmp_path_factory.mktemp(f"emb-{kind}")), kind)
        return cache[kind]
    return get


POOLING = {"base": ("last", True), "st_mean": ("mean", False), "st_last": ("last", True)}


def hf_embeddings(path: str, inputs: Sequence[List[int]], mode: str, normalize: bool) -> List[torch.Tensor]:
    """HF's base model in float64: last hidden state, pooled and normalised as sentence-transformers does."""
    import transformers
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for ids in inputs:
            h = model(torch.tensor([ids])).last_hidden_state[0]
            v = h[-1] if mode == "last" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], tol: float = TOL) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert rel(g, w) < tol, f"input {i}: off by {rel(g, w):.2e} (relative)"


# ---------------------------------------------------------------------------------------------- offline
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["base", "st_mean", "st_last"])
def test_embed_matches_hf_batched_and_alone(emb_model, kind) -> None:
    path = emb_model(kind)
    inputs = make_prompts(448, LENS, seed=11)
    want = hf_embeddings(path, inputs, *POOLING[kind])
    with make_llm(path, disable_radix_cache=False) as llm:
        assert (llm.engine.parts.pooling.mode, llm.engine.parts.pooling.normalize) == POOLING[kind]
        watch = EngineWatch(llm.engine)
        batched = llm.embed(inputs, use_tqdm=False)
        assert_close(batched, want)
        assert watch.steps < len(inputs)  # batched: fewer steps than inputs
        watch.assert_idle()
        alone = [llm.embed(x, use_tqdm=False)[0] for x in inputs]
        assert_close(alone, batched, 1e-5)
        assert_pool_free(llm.engine)
        if POOLING[kind][1]:
            assert all(abs(float(v.norm()) - 1.0) < 1e-5 for v in batched)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["st_mean", "st_last"])
def test_chunked_prefill_pools_across_chunks(emb_model, kind) -> None:
    """Inputs longer than the chunk, several in one budget (7 tokens a chunk, 9 a step): pooling accumulates
    across chunks. 15 and 22 leave one token after two / three chunks, which the scheduler must not leave to a
    decode step (an embedding request never decodes)."""
    path = emb_model(kind)
    inputs = make_prompts(448, [15, 22, 40, 3, 29, 8], seed=5)
    want = hf_embeddings(path, inputs, *POOLING[kind])
    with make_llm(path) as one_shot:
        whole = one_shot.embed(inputs, use_tqdm=False)
    with make_llm(path, chunked_prefill_size=7, max_prefill_tokens=9) as llm:
        watch = EngineWatch(llm.engine)
        chunked = llm.embed(inputs, use_tqdm=False)
        assert watch.partial_extends > 0 and "decode" not in watch.modes
        watch.assert_idle()
    assert_close(chunked, whole, 1e-5)
    assert_close(chunked, want)


@pytest.mark.slow
def test_last_token_reuses_a_cached_prefix_mean_does_not(emb_model) -> None:
    shared = make_prompts(448, [24], seed=3)[0]
    inputs = [shared + [7, 8, 9], shared + [10, 11]]
    for kind in ("st_last", "st_mean"):
        path = emb_model(kind)
        want = hf_embeddings(path, inputs, *POOLING[kind])
        with make_llm(path, disable_radix_cache=False) as llm:
            first = llm.embed(inputs[0], use_tqdm=False)
            req = llm.engine.make_request(inputs[1], PoolingParams())
            llm.engine.add(req)
            while llm.engine.has_work():
                llm.engine.step()
            assert (req.num_cached_tokens > 0) == (kind == "st_last"), kind
            assert_close(first + [torch.from_numpy(req.embedding.vector)], want)
            assert_pool_free(llm.engine)  # its pages were released to the prefix tree (evictable) or freed


def test_dimensions_truncate_then_normalise(emb_model) -> None:
    path = emb_model("base")
    inputs = make_prompts(448, [6, 9], seed=2)
    with make_llm(path) as llm:
        full = llm.embed(inputs, use_tqdm=False)
        short = llm.embed(inputs, dimensions=16, use_tqdm=False)
        for f, s in zip(full, short):
            assert s.shape == (16,)
            assert rel(s, torch.nn.functional.normalize(f[:16], dim=0)) < 1e-6
        with pytest.raises(RequestError, match="dimensions"):
            llm.embed(inputs, dimensions=65, use_tqdm=False)
        assert_pool_free(llm.engine)


def test_embedding_and_generation_models_refuse_each_other(emb_model, tiny_model) -> None:
    with make_llm(emb_model("base")) as llm:
        with pytest.raises(RequestError, match="embedding model"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(RequestError, match="empty"):
            llm.embed([[]], use_tqdm=False)
        with pytest.raises(RequestError, match="context length"):
            llm.embed([[5] * 257], use_tqdm=False)
    with make_llm(tiny_model("qwen3")) as llm:
        assert llm.engine.parts.pooling is None
        with pytest.raises(RequestError, match="serves no embeddings"):
            llm.embed([5, 6, 7], use_tqdm=False)
    # --is-embedding makes a causal LM an embedding model, with Qwen3-Embedding's defaults
    path = tiny_model("qwen3")
    with make_llm(path, is_embedding=True) as llm:
        assert (llm.engine.parts.pooling.mode, llm.engine.parts.pooling.normalize) == ("last", True)
        assert_close(llm.embed([[5, 6, 7]], use_tqdm=False), hf_embeddings(path, [[5, 6, 7]], "last", True))


def test_scoring_request_whose_chunks_leave_one_token_finishes(tiny_model) -> None:
    """The same rule for a request that only scores its prompt (max_tokens 0): 5 tokens in chunks of 4 used to
    leave the last one to a decode step it never got."""
    with make_llm(tiny_model("qwen3"), chunked_prefill_size=4) as llm:
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    assert out[0].finish_reason == "length" and len(out[0].prompt_logprobs) == 5


def _args(arch: str) -> ModelArgs:
    cfg = make_config("qwen3").to_dict()
    cfg["architectures"] = [arch]
    return ModelArgs.from_hf_config(cfg)


def test_detection_rules(tmp_path) -> None:
    causal, base = _args("Qwen3ForCausalLM"), _args("Qwen3Model")
    assert base.base_model and base.architecture == "Qwen3ForCausalLM" and base.qk_norm
    assert resolve_pooling(str(tmp_path), causal, False) is None  # a plain causal LM generates
    assert resolve_pooling(str(tmp_path), base, False).mode == "last"
    assert resolve_pooling(str(tmp_path), causal, True).normalize
    _write_st(str(tmp_path), "pooling_mode_mean_tokens", True)
    p = resolve_pooling(str(tmp_path), causal, False)
    assert (p.mode, p.normalize, p.dim) == ("mean", True, 64)
    _write_st(str(tmp_path), "pooling_mode_cls_token", False)
    with pytest.raises(WeightLoadError, match="pooling_mode_cls_token is not supported"):
        resolve_pooling(str(tmp_path), causal, False)
    with open(tmp_path / "modules.json", "w") as f:
        json.dump([{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
                   {"type": "sentence_transformers.models.Dense", "path": "2_Dense"}], f)
    with pytest.raises(WeightLoadError, match="Dense are not supported"):
        resolve_pooling(str(tmp_path), causal, False)


# ---------------------------------------------------------------------------------------------- HTTP, in process
class InlineEngine:
    """Stands in for EngineClient with a real engine stepped on the event loop: every request a route submits
    before it awaits goes into the same steps, as in the engine process."""

    ready, dead = True, False

    def __init__(self, engine) -> None:
        self.engine = engine
        self.routes: Dict[str, Any] = {}
        self.task = None

    def submit(self, rid, prompt_ids, params, sink, tag) -> None:
        try:
            self.engine.add(self.engine.make_request(prompt_ids, params, rid))
        except RequestError as e:
            asyncio.get_running_loop().call_soon(sink.put_nowait, (tag, e))
            return
        self.routes[rid] = (sink, tag)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        await asyncio.sleep(0)
        while self.engine.has_work():
            for out in self.engine.step():
                route = self.routes.pop(out.rid, None) if out.finished else self.routes.get(out.rid)
                if route is not None:
                    route[0].put_nowait((route[1], out))
            await asyncio.sleep(0)

    def abort(self, rid: str) -> None:
        if self.routes.pop(rid, None) is not None:
            self.engine.abort(rid)

    async def fresh_stats(self, timeout: float = 0.5) -> Dict[str, Any]:
        return {}


def _app(llm):
    state = ServerState(client=InlineEngine(llm.engine), tokenizer=llm.tokenizer,
                        info=EngineInfo.from_engine(llm.engine), served_model_name="m")
    return create_app(state)


def _post(app, calls: Sequence[tuple]) -> List[httpx.Response]:
    async def run() -> List[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            return [await h.post(path, json=body, timeout=30) for path, body in calls]
    return asyncio.run(run())


def test_endpoint_in_process(emb_model) -> None:
    path = emb_model("base")
    texts = ["t5 t6 t7", "t9 t10 t11 t12 t13", "t5 t6 t7"]
    with make_llm(path, disable_radix_cache=False) as llm:
        ids = [llm.tokenizer(t).input_ids for t in texts]
        want = hf_embeddings(path, ids, "last", True)
        app = _app(llm)
        r = _post(app, [("/v1/embeddings", {"input": texts, "model": "m"}),
                        ("/v1/embeddings", {"input": texts[1], "encoding_format": "base64", "dimensions": 8}),
                        ("/v1/embeddings", {"input": ids[1], "dimensions": 8}),
                        ("/v1/embeddings", {"input": ids})])
        assert all(x.status_code == 200 for x in r), [x.text for x in r]
        body = r[0].json()
        assert body["object"] == "list" and body["model"] == "m"
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"embedding"}
        n = sum(len(x) for x in ids)
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
        got = [torch.tensor(d["embedding"]) for d in body["data"]]
        assert_close(got, want)
        assert float(got[0] @ got[2]) == pytest.approx(1.0, abs=1e-6)  # the same text: cosine 1
        decoded = np.frombuffer(base64.b64decode(r[1].json()["data"][0]["embedding"]), dtype="<f4")
        assert decoded.tolist() == r[2].json()["data"][0]["embedding"]  # base64 is the float32 bytes
        assert rel(torch.from_numpy(decoded.copy()), torch.nn.functional.normalize(want[1][:8], dim=0)) < TOL
        assert_close([torch.tensor(d["embedding"]) for d in r[3].json()["data"]], want)  # token ids as input
        assert_pool_free(llm.engine)


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["t5", ""]}, "input"), ({"input": [[]]}, "input"),
    ({"input": [1.5]}, "input"), ({"input": "t5", "dimensions": 65}, "dimensions"),
    ({"input": "t5", "dimensions": 0}, "dimensions"), ({"input": [5] * 300}, "input"),
    ({"input": [5, 999]}, "input"), ({"input": "t5", "encoding_format": "int8"}, "encoding_format"),
])
def test_endpoint_400s_and_the_server_goes_on(emb_model, body, param) -> None:
    with make_llm(emb_model("base")) as llm:
        r = _post(_app(llm), [("/v1/embeddings", body), ("/v1/embeddings", {"input": "t5 t6"})])
        assert r[0].status_code == 400, r[0].text
        err = r[0].json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert r[1].status_code == 200 and len(r[1].json()["data"][0]["embedding"]) == 64
        assert_pool_free(llm.engine)


def test_generation_and_embedding_servers_refuse_each_other(emb_model, tiny_model) -> None:
    with make_llm(emb_model("base")) as llm:
        r = _post(_app(llm), [("/v1/completions", {"prompt": "t5 t6", "max_tokens": 2}),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}]})])
        for x in r:
            assert x.status_code == 400 and x.json()["error"]["code"] == "model_is_embedding", x.text
            assert "/v1/embeddings" in x.json()["error"]["message"]
    with make_llm(tiny_model("qwen3")) as llm:
        r = _post(_app(llm), [("/v1/embeddings", {"input": "t5 t6"}),
                              ("/v1/completions", {"prompt": "t5 t6", "max_tokens": 2})])
        assert r[0].status_code == 400 and r[0].json()["error"]["code"] == "model_not_embedding", r[0].text
        assert r[1].status_code == 200


# ---------------------------------------------------------------------------------------------- a server process
@pytest.mark.slow
def test_openai_client_against_a_server_process(emb_model) -> None:
    openai = pytest.importorskip("openai")

    from .helpers.server_process import running
    path = emb_model("st_last")
    with running("--model", path, "--attention-backend", "torch", "--chunked-prefill-size", "16") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        texts = ["t5 t6 t7 t8", " ".join(f"t{i}" for i in range(3, 60)), "t5 t6 t7 t8"]
        r = client.embeddings.create(model=os.path.basename(path), input=texts, encoding_format="float")
        vecs = [torch.tensor(d.embedding) for d in r.data]
        assert [d.index for d in r.data] == [0, 1, 2] and all(v.shape == (64,) for v in vecs)
        assert float(vecs[0] @ vecs[2]) == pytest.approx(1.0, abs=1e-6)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)
        ids = [tok(t).input_ids for t in texts]
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(x) for x in ids)
        assert_close(vecs, hf_embeddings(path, ids, "last", True))  # the 57-token input in chunks of 16
        short = client.embeddings.create(model=os.path.basename(path), input=texts[0], dimensions=8)
        assert len(short.data[0].embedding) == 8
        assert rel(torch.tensor(short.data[0].embedding), torch.nn.functional.normalize(vecs[0][:8], dim=0)) < 1e-6
        # base64 is the float32 bytes of the same vector (alone, the same computation: both start from the prefix
        # the batch above left in the cache); the openai client asks for base64 by default and decodes it itself
        alone = client.embeddings.create(model=os.path.basename(path), input=texts[0], encoding_format="float")
        b64 = httpx.post(srv.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
        raw = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
        assert raw.tolist() == alone.data[0].embedding
        assert client.embeddings.create(input=texts[0], model=os.path.basename(path)).data[0].embedding == \
            pytest.approx(raw.tolist(), abs=1e-7)
        for bad in ({"input": ""}, {"input": texts[0], "dimensions": 65}, {"input": [5] * 300}):
            with pytest.raises(openai.BadRequestError):
                client.embeddings.create(model=os.path.basename(path), encoding_format="float", **bad)
        with pytest.raises(openai.BadRequestError, match="embedding model"):
            client.completions.create(model=os.path.basename(path), prompt="t5", max_tokens=2)
        again = client.embeddings.create(model=os.path.basename(path), input=texts, encoding_format="float")
        assert_close([torch.tensor(d.embedding) for d in again.data], vecs, 1e-6)  # the server goes on
