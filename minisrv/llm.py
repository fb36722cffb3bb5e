"""The offline API: `LLM().generate(prompts, SamplingParams(...))`, `LLM().chat(messages)` and, on an embedding
model, `LLM().embed(texts)`, over an Engine."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from minisrv.config import EngineConfig
from minisrv.engine.engine import Engine
from minisrv.engine.pooling import PoolingParams
from minisrv.engine.request import CompletionOutput, Request, SamplingParams, prompt_logprob_list
from minisrv.replica_pool import Finished, ReplicaPool
from minisrv.server.plan.chat import ChatInputs, finish_plan, prompt_text
from minisrv.server.plan.prompt import PromptMaker
from minisrv.tokenizer.engine_tokenizer import transformers_tokenizer

PromptType = Union[str, List[int]]


class LLM:
    """Offline batch generation: every prompt is queued at once and the engine runs until all are done. With
    dp_size N > 1, N engine replicas in processes of their own (on GPUs base_gpu_id + r * tp_size ...) share each
    call's prompts (replica_pool.py); `engine` is then None."""

    def __init__(self, model: Optional[str] = None, attention_backend: str = "auto", dp_size: int = 1,
                 **kwargs: Any) -> None:
        cfg = EngineConfig(model=model, attention_backend=attention_backend, **kwargs)
        if dp_size < 1 or (dp_size > 1 and cfg.nnodes > 1):
            raise ValueError("dp_size must be >= 1, and 1 across nodes (nnodes > 1)")
        self.engine: Optional[Engine] = Engine(cfg) if dp_size == 1 else None
        self.replicas = ReplicaPool(cfg, dp_size) if dp_size > 1 else None
        self._prompts: Optional[PromptMaker] = None  # the chat plan's view of the tokenizer, made on first use

    @property
    def tokenizer(self) -> Any:
        """transformers' tokenizer of the model (built on first use: the engine streams text without it)."""
        return transformers_tokenizer(self.engine.parts.tokenizer if self.engine is not None else
                                      self.replicas.tokenizer)

    def close(self) -> None:
        """Stop the engine's tensor-parallel processes, or the replicas (also done at interpreter exit)."""
        if self.engine is not None:
            self.engine.close()
        else:
            self.replicas.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _encode(self, prompt: PromptType) -> List[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        # every element an int, tested once per distinct element type (a C loop over a 4k-token prompt)
        if isinstance(prompt, (list, tuple)) and all(issubclass(t, int) for t in set(map(type, prompt))):
            return list(prompt)
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True) -> List[CompletionOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self._encode(x) for x in prompts]
        done = self._complete(ids, params, use_tqdm, "generate")
        return [CompletionOutput(prompt=p if isinstance(p, str) else None, prompt_token_ids=i, text=d.text,
                                 token_ids=d.token_ids, finish_reason=d.finish_reason,
                                 logprobs=d.logprobs if sp.logprobs is not None else None,
                                 prompt_logprobs=d.prompt_logprobs)
                for p, i, sp, d in zip(prompts, ids, params, done)]

    def embed(self, inputs: Union[PromptType, Sequence[PromptType]], dimensions: Optional[int] = None,
              use_tqdm: bool = True) -> List[torch.Tensor]:
        """An embedding model's vectors, one per input (a text, tokenized with the tokenizer's special tokens, or
        a list of token ids): 1-D float32 CPU tensors, normalised as the model's pooling says; `dimensions` keeps
        the first n entries (normalised again). A generation model raises RequestError."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        params = [PoolingParams(dimensions)] * len(inputs)
        done = self._complete([self._encode(x) for x in inputs], params, use_tqdm, "embed")
        return [torch.from_numpy(d.embedding) for d in done]

    def _complete(self, ids: List[List[int]], params: Sequence[Union[SamplingParams, PoolingParams]],
                  use_tqdm: bool, desc: str) -> List[Finished]:
        """Each prompt's request run to its end, on the replicas or the engine (a refused or failed one raises)."""
        if self.replicas is not None:
            with _progress(len(ids), use_tqdm, desc) as bar:
                return self.replicas.run(ids, params, bar)
        eng = self.engine
        reqs = [eng.make_request(i, p) for i, p in zip(ids, params)]  # all checked before any runs
        for p in {id(p): p for p in params if isinstance(p, SamplingParams)}.values():
            eng.grammar.check(p)  # an invalid schema, regex or grammar raises here (compiled once, then cached)
        self._run(reqs, use_tqdm, desc)
        return [Finished(embedding=r.embedding.vector) if r.embedding is not None else
                Finished(text=r.text.text, token_ids=list(r.output_ids), logprobs=list(r.logprobs),
                         prompt_logprobs=prompt_logprob_list(r), finish_reason=r.finish_reason) for r in reqs]

    def _run(self, reqs: List[Request], use_tqdm: bool, desc: str) -> None:
        """Queue every request and step the engine until all have finished (a failed one raises)."""
        eng = self.engine
        for r in reqs:
            eng.add(r)
        live = {r.rid for r in reqs}
        with _progress(len(reqs), use_tqdm, desc) as bar:
            try:
                while live:
                    for out in eng.step():
                        if out.finished and out.rid in live:
                            live.discard(out.rid)
                            if out.error is not None:
                                raise RuntimeError(f"request {out.rid} failed: {out.error}")
                            bar.update(1)
                    if not eng.has_work() and live:
                        raise RuntimeError(f"engine stopped with {len(live)} unfinished requests")
            except BaseException:
                for rid in live:
                    eng.abort(rid)
                raise

    def chat(self, messages: Union[List[Dict[str, str]], List[List[Dict[str, str]]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True) -> List[CompletionOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.encode_chat(c) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, messages: List[Dict[str, str]]) -> List[int]:
        """A conversation's prompt ids, made by the request plan the server's chat APIs use (a system message
        anywhere is templated in its place, or joined to the first where the template refuses it there)."""
        if self._prompts is None:
            self._prompts = PromptMaker.of(self.tokenizer)
        inputs = ChatInputs(list(messages))
        prompt, tools = prompt_text(self._prompts, inputs)
        return finish_plan(self._prompts, inputs, prompt, tools, None).prompt_ids


def _progress(total: int, use_tqdm: bool, desc: str) -> Any:
    """A progress bar over `total` requests, shown where asked for and for two or more."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="req", disable=not use_tqdm or total < 2)
