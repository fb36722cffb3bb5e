"""End to end on a random-weight Qwen3-0.6B-shaped checkpoint in bf16, per backend, against HF transformers."""
import pytest
import torch

from minisrv import LLM, SamplingParams
from .common import CKPT, free_cuda, mixed_prompts, requires_ckpt, skip_unless_runs

pytestmark = requires_ckpt

BACKENDS = ["fa", "fi", "fa,fi", "fa,triton", "torch"]
N_PROMPTS, N_NEW = 16, 32


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(N_PROMPTS, 5, 300, seed=1)


@torch.inference_mode()
def _prefill_logits(llm, prompts):
    """Our logits at every prompt position, from one prefill step through the engine's own batch path."""
    eng = llm.engine
    assert eng.flush_cache()  # every prompt position is computed in this step, none taken from the cache
    reqs = [eng.add_request(p, SamplingParams(max_tokens=1, temperature=0)) for p in prompts]
    batch = eng.scheduler.schedule()
    assert batch is not None and len(batch.reqs) == len(prompts) and all(batch.samples)
    fb = eng.runner.build_forward_batch(batch)
    runner = eng.runner
    hidden = runner.model(fb.input_ids, fb.positions, runner.backend.step(fb))
    logits = runner.model.compute_logits(hidden)
    eng.scheduler.commit(batch)
    for r in reqs:
        eng.abort(r.rid)
    assert eng.flush_cache()  # the aborted prompts' pages went to the cache: hand them back
    splits = [len(p) for p in prompts]
    return list(torch.split(logits, splits))


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_and_prefill_match_hf(backend, prompts, hf):
    skip_unless_runs(backend)
    llm = LLM(model=CKPT, attention_backend=backend, dtype="bfloat16", max_total_tokens=65536, page_size=1,
              log_level="warning")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                            use_tqdm=False)
        ours_prefill = _prefill_logits(llm, prompts)
        assert llm.engine.parts.allocator.num_free == llm.engine.num_free_pages_when_idle
    finally:
        del llm
        free_cuda()
    worst_gap = 0.0
    for p, o, ours in zip(prompts, outs, ours_prefill):
        assert len(o.token_ids) == N_NEW
        ids = torch.tensor([p + o.token_ids], device="cuda")
        with torch.inference_mode():
            ref = hf(ids).logits[0].float()  # [len(p) + N_NEW, V]
        # each generated token is HF's argmax at that position, or within 0.1 logit of it (bf16 ties)
        at = ref[len(p) - 1: len(p) - 1 + N_NEW]
        chosen = at.gather(1, torch.tensor(o.token_ids, device="cuda")[:, None]).squeeze(1)
        gap = (at.max(dim=1).values - chosen).max().item()
        worst_gap = max(worst_gap, gap)
        assert gap <= 0.1, f"{backend}: a generated token is {gap:.3f} logits below HF's argmax"
        # prefill logits over the whole prompt
        rel = (ours - ref[:len(p)]).norm() / ref[:len(p)].norm()
        assert rel < 5e-2, f"{backend}: prefill logits relative error {rel:.3e}"
    print(f"{backend}: worst gap to HF argmax {worst_gap:.4f}")
