"""Tensor parallelism over two GPUs (NCCL): greedy tokens against HF transformers, as in test_e2e.py, and CUDA-graph
replay against eager decode, as in test_cuda_graph.py, with tp 2.

An engine with the fused all-reduce sets up torch's symmetric memory, which torch allows once a process
(distributed.SymmetricMemoryUse): each such engine runs in a new process of its own (`_in_new_process`)."""
import concurrent.futures
import multiprocessing

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


def _in_new_process(fn, *args):
    """fn(*args) in a new Python process (spawned: no CUDA or torch.distributed state of this one), its result."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _greedy_outputs(backend, fusion, prompts):
    with _llm(backend, enable_flashinfer_allreduce_fusion=fusion) as llm:
        assert llm.engine.parts.pool.num_kv_heads * 2 == llm.engine.parts.args.num_kv_heads
        assert (llm.engine.runner.tp.fused_norm is not None) == fusion
        return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                            use_tqdm=False)


@pytest.mark.parametrize("backend,fusion", [("fa,fi", False), ("fi", False), ("fa,fi", True)])
def test_tp2_greedy_matches_hf(backend, fusion):
    """fusion: decode steps all-reduce, add and normalise in FlashInfer's fused kernel (prefill keeps NCCL)."""
    skip_unless_runs(backend)
    prompts = mixed_prompts(16, 5, 300, seed=1)
    outs = _in_new_process(_greedy_outputs, backend, fusion, prompts) if fusion else \
        _greedy_outputs(backend, fusion, prompts)
    free_cuda()
    hf = hf_model()
    assert_near_hf_greedy(hf, prompts, outs, N_NEW, 0.1, f"{backend} tp 2" + (" fused norm" if fusion else ""))
    del hf
    free_cuda()


GRAPH_SIZES = (1, 17, 64)


def _graph_or_eager_outputs(backend, fusion, graphs):
    with _llm(backend, disable_cuda_graph=not graphs, cuda_graph_max_bs=64,
              enable_flashinfer_allreduce_fusion=fusion) as llm:
        assert (llm.engine.runner.graph_runner is not None) == graphs
        assert (llm.engine.runner.tp.fused_norm is not None) == fusion
        return [llm.generate(mixed_prompts(bs, 8, 200, seed=bs),
                             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
                             use_tqdm=False) for bs in GRAPH_SIZES]


@pytest.mark.parametrize("backend,fusion", [("fa,fi", False), ("fa,fi", True)])
def test_tp2_graph_replay_equals_eager(backend, fusion):
    skip_unless_runs(backend)
    runs = []
    for graphs in (False, True):
        runs.append(_in_new_process(_graph_or_eager_outputs, backend, fusion, graphs) if fusion else
                    _graph_or_eager_outputs(backend, fusion, graphs))
        free_cuda()
    for bs, eager, graph in zip(GRAPH_SIZES, *runs):
        assert_same_up_to_ties(eager, graph, f"tp 2 bs={bs}")


def _second_fused_engine_error():
    """In this (new) process: a fused engine that runs, then a second one; the second's error message."""
    prompts = mixed_prompts(2, 5, 20)
    with _llm("fa,fi", enable_flashinfer_allreduce_fusion=True) as llm:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    try:
        _llm("fa,fi", enable_flashinfer_allreduce_fusion=True).close()
    except RuntimeError as e:
        return str(e)
    return None


def test_a_second_fused_engine_in_one_process_is_refused_not_hung():
    """torch's symmetric memory counts its rendezvous per process: a second engine with the fused all-reduce in a
    process would wait forever at its set-up. It is refused with an error that says so."""
    skip_unless_runs("fa,fi")
    error = _in_new_process(_second_fused_engine_error)
    assert error is not None and "new process" in error, error
