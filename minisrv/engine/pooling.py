"""Embedding requests: a prompt's prefill, with its hidden states pooled into one vector instead of a token sampled.

An embedding request is a `Request` with no output budget (max_new_tokens 0) and an `EmbeddingState`; the scheduler
runs its prefill like any other, in chunks when long, and never decodes it. Each extend step's hidden states are
pooled on the device: mean pooling keeps a float32 running sum there chunk by chunk (so overlap scheduling needs no
wait) and never starts from a cached prefix (a chunk at position 0 starts a new sum: a request retried from scratch
after a failed step); last-token pooling takes the last chunk's last row. At its last chunk the vector goes to the
host; read back, it is truncated to the request's `dimensions` and the request ends like any other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

from .request import Request, RequestError, RequestLimits, SamplingParams, _ids_in_range, _is_int

if TYPE_CHECKING:  # torch only where vectors are pooled: the HTTP process imports this module for its checks
    import torch

    from minisrv.checkpoints.pooling_config import PoolingConfig


@dataclass(frozen=True)
class PoolingParams:
    """What an embedding request asks for: `dimensions`, the vector's first n entries (a Matryoshka model's
    shorter embedding), normalised again when the model's vectors are; None: all of them."""

    dimensions: Optional[int] = None


@dataclass(eq=False)
class EmbeddingState:
    """An embedding request's pooling so far: the mean's running sum on the device, then the vector on the host."""

    params: PoolingParams
    mean: bool  # mean pooling: every position's hidden state is needed (no cached prefix)
    running_sum: Optional[torch.Tensor] = None  # [hidden] float32 on the device, the chunks so far (mean)
    vector: Optional[Any] = None  # the result: a float32 numpy array [dimensions]


EMBEDDING_SAMPLING = SamplingParams()  # what the scheduler reads of an embedding request: the defaults


def check_embedding_input(prompt_ids: Sequence[int], dim: int, params: PoolingParams, limits: RequestLimits,
                          prompt_param: str = "input") -> None:
    """An embedding request against the model whose vectors have `dim` entries (0: a generation model), the one
    check of the engine and the HTTP side (raises RequestError): the model embeds, the ids are in its vocabulary,
    the input fits in its context, `dimensions` is at most the model's."""
    if not dim:
        raise RequestError("this model generates text and serves no embeddings (an embedding model is one with "
                           "sentence-transformers pooling files or no LM head, or one served with --is-embedding)",
                           "model", "model_not_embedding")
    if not prompt_ids:
        raise RequestError("the input is empty", prompt_param)
    if not _ids_in_range(prompt_ids, limits.vocab_size):
        raise RequestError(f"input token ids must be integers in [0, {limits.vocab_size})", prompt_param)
    if len(prompt_ids) > limits.max_request_len:
        raise RequestError(f"This model's maximum context length is {limits.max_request_len} tokens. However, "
                           f"your input has {len(prompt_ids)} tokens.", prompt_param, "context_length_exceeded")
    d = params.dimensions
    if d is not None and (not _is_int(d) or not 1 <= d <= dim):
        raise RequestError(f"dimensions must be an integer in [1, {dim}] (the model's embedding size), "
                           f"got {d!r}", "dimensions")


def embedding_request(prompt_ids: Sequence[int], params: Any, pooling: Optional[PoolingConfig],
                      limits: RequestLimits, eos_ids: Sequence[int], rid: Optional[str] = None) -> Request:
    """A checked embedding request (PoolingParams on an embedding model); a generation request to an embedding
    model, or an embedding request to a generation model, is a RequestError."""
    if not isinstance(params, PoolingParams):
        raise RequestError("this is an embedding model: it serves embeddings (/v1/embeddings, LLM.embed), not "
                           "completions or chat", "model", "model_is_embedding")
    check_embedding_input(prompt_ids, pooling.dim if pooling is not None else 0, params, limits)
    return Request(list(prompt_ids), EMBEDDING_SAMPLING, 0, rid, eos_ids=eos_ids,
                   embedding=EmbeddingState(params, pooling.mode == "mean"))


@dataclass
class PooledStep:
    """The vectors an extend step finished (host copies, complete when the step's event is), for `owners`."""

    owners: List[Request] = field(default_factory=list)
    host: Optional[torch.Tensor] = None  # [len(owners), hidden] float32
    normalize: bool = True

    def store(self) -> List[Request]:
        """Each owner's vector, truncated to its dimensions, into its EmbeddingState; returns the owners."""
        import torch
        for k, req in enumerate(self.owners):
            v = self.host[k]
            d = req.embedding.params.dimensions
            if d is not None and d < v.numel():
                v = v[:d]
                if self.normalize:
                    v = torch.nn.functional.normalize(v, dim=0)
            req.embedding.vector = v.clone().numpy()  # its own buffer: a view would pickle the whole batch
        return self.owners


class Pooler:
    def __init__(self, config: PoolingConfig) -> None:
        self.config = config

    def pool(self, reqs: Sequence[Request], extend_lens: Sequence[int], hidden: torch.Tensor,
             to_host: Callable[[torch.Tensor], torch.Tensor]) -> PooledStep:
        """Pool one step's hidden states [T, hidden] (launch time: each request's num_cached is where its chunk
        starts); the vectors of the requests whose prompt this step completes go to the host."""
        import torch
        dev = hidden.device
        ends = torch.tensor(extend_lens).cumsum(0) - 1
        if self.config.mode == "mean":
            seg = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(extend_lens)).to(dev)
            sums = torch.zeros(len(reqs), hidden.shape[1], dtype=torch.float32, device=dev)
            sums.index_add_(0, seg, hidden.float())
        else:
            last = hidden[ends.to(dev)].float()
        owners, vectors = [], []
        for i, (r, n) in enumerate(zip(reqs, extend_lens)):
            st = r.embedding
            if self.config.mode == "mean":
                total = sums[i] if r.num_cached == 0 or st.running_sum is None else st.running_sum + sums[i]
                st.running_sum = total
            if r.num_cached + n < len(r.prompt_ids):
                continue  # a chunk: more to come
            owners.append(r)
            vectors.append(total / len(r.prompt_ids) if self.config.mode == "mean" else last[i])
            st.running_sum = None
        if not owners:
            return PooledStep()
        out = torch.stack(vectors)
        if self.config.normalize:
            out = torch.nn.functional.normalize(out, dim=-1)
        return PooledStep(owners, to_host(out), self.config.normalize)
