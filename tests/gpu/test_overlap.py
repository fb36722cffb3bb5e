"""Overlap scheduling on the GPU: a decode step is scheduled and launched without waiting for the device, and the
tokens are the same as with overlap off.

The first test runs decode steps under torch's sync debug mode, which warns on every call that blocks the host
until the stream drains (blocking host->device copies, .item(), .cpu(), stream or device synchronize). The one
wait the engine means to make, on the previous step's event before reading its sampled tokens, is an event
wait and is not reported.
"""

import pytest

from minisrv import LLM, SamplingParams
from .common import CKPT, free_cuda, mixed_prompts, requires_ckpt, skip_unless_runs, start_decoding, stream_syncs

pytestmark = requires_ckpt
BACKENDS = ["fa,fi", "fi", "fa"]


def _llm(backend, **kw):
    skip_unless_runs(backend)
    return LLM(model=CKPT, attention_backend=backend, dtype="bfloat16", max_total_tokens=65536,
               cuda_graph_max_bs=64, log_level="warning", **kw)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_steps_never_synchronise(backend, graphs):
    llm = _llm(backend, disable_cuda_graph=not graphs)
    eng = llm.engine
    try:
        assert eng.overlap
        reqs = start_decoding(eng, mixed_prompts(24, 10, 300, seed=5),
                              SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True))
        syncs = stream_syncs(lambda step=eng.step: [step() for _ in range(16)])
        assert not syncs, "decode steps synchronised the stream at:\n" + "\n".join(syncs)
        for r in reqs:
            eng.abort(r.rid)
    finally:
        del llm, eng
        free_cuda()


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_gives_the_same_tokens(backend):
    prompts = mixed_prompts(20, 5, 400, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(10, 50, 2)]
    params[3] = SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)  # seeded: reproducible
    outs = {}
    for overlap in (True, False):
        llm = _llm(backend, disable_overlap_schedule=not overlap)
        try:
            assert llm.engine.overlap == overlap
            outs[overlap] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            del llm
            free_cuda()
    for i, (a, b) in enumerate(zip(outs[True], outs[False])):
        assert len(a) == len(b) == params[i].max_tokens
        assert a == b, f"request {i}: overlap on and off differ"
