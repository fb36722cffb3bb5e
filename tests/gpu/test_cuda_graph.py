"""CUDA-graph decode replay gives the same tokens as eager decode (batch sizes 1, 3, 17 and 64)."""
import pytest

from minisrv import LLM, SamplingParams
from .common import CKPT, assert_same_up_to_ties, free_cuda, mixed_prompts, requires_ckpt, skip_unless_runs

pytestmark = requires_ckpt
N_NEW = 24


def _run(backend, graphs, prompts):
    llm = LLM(model=CKPT, attention_backend=backend, dtype="bfloat16", max_total_tokens=65536,
              disable_cuda_graph=not graphs, cuda_graph_max_bs=64, log_level="warning")
    try:
        assert (llm.engine.runner.graph_runner is not None) == graphs
        return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=2),
                            use_tqdm=False)
    finally:
        del llm
        free_cuda()


@pytest.mark.parametrize("backend", ["fa,fi", "fi", "fa", "fa,triton"])
def test_graph_replay_equals_eager(backend):
    skip_unless_runs(backend)
    for bs in (1, 3, 17, 64):
        prompts = mixed_prompts(bs, 8, 200, seed=bs)
        eager = _run(backend, False, prompts)
        graph = _run(backend, True, prompts)
        assert_same_up_to_ties(eager, graph, f"{backend} bs={bs}")
