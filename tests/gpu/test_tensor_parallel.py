"""Tensor parallelism over two GPUs (NCCL): greedy tokens against HF transformers, as in test_e2e.py, and CUDA-graph
replay against eager decode, as in test_cuda_graph.py, with tp 2."""
import pytest
import torch

from minisrv import LLM, SamplingParams
from .common import (CKPT, assert_near_hf_greedy, assert_same_up_to_ties, free_cuda, hf_model, mixed_prompts,
                     requires_ckpt, skip_unless_runs)

pytestmark = [requires_ckpt, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
N_NEW = 32


def _llm(backend, **kw):
    return LLM(model=CKPT, attention_backend=backend, dtype="bfloat16", max_total_tokens=65536, tp_size=2,
               log_level="warning", **kw)


@pytest.mark.parametrize("backend,fusion", [("fa,fi", False), ("fi", False), ("fa,fi", True)])
def test_tp2_greedy_matches_hf(backend, fusion):
    """fusion: decode steps all-reduce, add and normalise in FlashInfer's fused kernel (prefill keeps NCCL)."""
    skip_unless_runs(backend)
    prompts = mixed_prompts(16, 5, 300, seed=1)
    with _llm(backend, enable_flashinfer_allreduce_fusion=fusion) as llm:
        assert llm.engine.pool.num_kv_heads * 2 == llm.engine.args.num_kv_heads
        assert (llm.engine.runner.tp.fused_norm is not None) == fusion
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                            use_tqdm=False)
    free_cuda()
    hf = hf_model()
    assert_near_hf_greedy(hf, prompts, outs, N_NEW, 0.1, f"{backend} tp 2" + (" fused norm" if fusion else ""))
    del hf
    free_cuda()


@pytest.mark.parametrize("backend,fusion", [("fa,fi", False), ("fa,fi", True)])
def test_tp2_graph_replay_equals_eager(backend, fusion):
    skip_unless_runs(backend)
    sizes = (1, 17, 64)
    runs = []
    for graphs in (False, True):
        with _llm(backend, disable_cuda_graph=not graphs, cuda_graph_max_bs=64,
                  enable_flashinfer_allreduce_fusion=fusion) as llm:
            assert (llm.engine.runner.graph_runner is not None) == graphs
            runs.append([llm.generate(mixed_prompts(bs, 8, 200, seed=bs),
                                      SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
                                      use_tqdm=False) for bs in sizes])
        free_cuda()
    for bs, eager, graph in zip(sizes, *runs):
        assert_same_up_to_ties(eager, graph, f"tp 2 bs={bs}")
