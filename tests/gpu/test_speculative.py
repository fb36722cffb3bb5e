"""Speculative decoding on the GPU: drafts replayed from the plain run (corrupted at a set rate) give the plain
run's tokens up to bf16 near-ties, with verify steps replayed from their CUDA graphs (fa,fi: FA3's verify call) or
eager (fi, graphs off), over a bf16 and an FP8 pool, at batch sizes a graph pads up (3) and that fill one (8)."""
import pytest

from minisrv import LLM, SamplingParams

from ..test_speculative import ReplayProposer
from .common import CKPT, assert_same_up_to_ties, free_cuda, mixed_prompts, requires_ckpt, skip_unless_runs

pytestmark = requires_ckpt
N_NEW = 40


def _run(prompts, backend, graphs=True, runs=None, **kw):
    spec = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5) if runs is not None else {}
    llm = LLM(model=CKPT, attention_backend=backend, dtype="bfloat16", max_total_tokens=65536,
              disable_cuda_graph=not graphs, cuda_graph_max_bs=64, log_level="warning", **spec, **kw)
    replays = []
    try:
        if runs is not None:
            llm.engine.speculator.proposer = ReplayProposer(runs, 10000, corrupt=0.3)
            verify = llm.engine.runner.graph_runner.verify if graphs else None
            if backend == "fa,fi" and graphs:
                assert verify is not None, "fa,fi captures verify graphs"
            if verify is not None:
                replay = verify.replay
                verify.replay = lambda fb: replays.append(fb.batch_size) or replay(fb)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=2),
                            use_tqdm=False)
        return outs, llm.engine.stats(), replays
    finally:
        del llm
        free_cuda()


@pytest.mark.parametrize("backend,graphs,kv", [("fa,fi", True, "auto"), ("fa,fi", True, "fp8_e4m3"),
                                               ("fa,fi", False, "auto"), ("fi", True, "auto")])
def test_verified_tokens_are_the_plain_runs(backend, graphs, kv):
    skip_unless_runs(backend)
    for bs in (1, 3, 8):
        prompts = mixed_prompts(bs, 8, 300, seed=bs)
        plain, _, _ = _run(prompts, backend, graphs, kv_cache_dtype=kv)
        runs = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
        spec, stats, replays = _run(prompts, backend, graphs, runs, kv_cache_dtype=kv)
        assert_same_up_to_ties(plain, spec, f"{backend} graphs={graphs} kv={kv} bs={bs}")
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        if backend == "fa,fi" and graphs:
            assert replays, "no verify step replayed a graph"


@pytest.mark.parametrize("graphs", [True, False], ids=["verify-graphs", "eager"])
def test_eagle3_tokens_are_the_plain_runs(tmp_path, graphs):
    """EAGLE3 with a random head for the checkpoint's shape: its drafts are rarely kept, but every step that drafts
    or refreshes runs the head over the target's layer inputs, read from the verify graphs (or eagerly), and the
    tokens stay the plain run's up to bf16 near-ties."""
    from ..helpers.eagle_heads import save_eagle3_head
    skip_unless_runs("fa,fi")
    head = save_eagle3_head(str(tmp_path / "head"), CKPT, draft_vocab=4096,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 13, 24]})
    prompts = mixed_prompts(3, 8, 300, seed=5)
    plain, _, _ = _run(prompts, "fa,fi", graphs)
    llm = LLM(model=CKPT, attention_backend="fa,fi", dtype="bfloat16", max_total_tokens=65536,
              disable_cuda_graph=not graphs, cuda_graph_max_bs=64, log_level="warning",
              speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=3)
    try:
        verify = llm.engine.runner.graph_runner.verify if graphs else None
        assert not graphs or (verify is not None and verify.read_aux)
        spec = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=2),
                            use_tqdm=False)
        stats = llm.engine.stats()
    finally:
        del llm
        free_cuda()
    assert_same_up_to_ties(plain, spec, f"EAGLE3 graphs={graphs}")
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
