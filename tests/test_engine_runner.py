"""The model runner's step buffer and the phase timer: a step's integer fields packed into one host buffer and viewed
back by name give each field's values as built by hand; the phase timer leaves a run's tokens as they were and
charges every phase of it."""
from __future__ import annotations

import torch

from minisrv.engine.phase_timer import time_phases
from minisrv.engine.step_inputs import FIELDS, StepLayout

from .helpers import greedy, make_llm, make_prompts, vocab_of


def test_step_buffer_fields_round_trip_by_name():
    ids, pos = [11, 12, 13, 21, 22], [0, 1, 2, 7, 8]
    rows, seq_lens, cu = [3, 5], [3, 9], [0, 3, 5]
    last, pending = [2, 4], [-1, 1]
    slots = torch.tensor([40, 41, 42, 90, 91], dtype=torch.int64)
    layout = StepLayout(num_tokens=5, batch_size=2, num_pending=2, num_logit_rows=2)
    buf = layout.pack(False, slots, input_ids=ids, positions=pos, req_rows=rows, logit_rows=last,
                      seq_lens=seq_lens, cu_seqlens_q=cu, pending_rows=pending)
    assert buf.dtype == torch.int64 and buf.numel() == 6 + 6 + 2 + 2 + 2 + 4 + 2 + 5  # odd fields padded to even
    f = layout.unpack(buf)
    want = dict(input_ids=ids, positions=pos, req_rows=rows, logit_rows=last, seq_lens=seq_lens, cu_seqlens_q=cu,
                pending_rows=pending, out_cache_loc=slots.tolist())
    assert set(want) == set(FIELDS)
    for name, values in want.items():
        assert getattr(f, name).tolist() == values, name
    assert f.seq_lens.dtype == f.cu_seqlens_q.dtype == torch.int32
    assert f.input_ids.data_ptr() == buf.data_ptr()  # a view of the one buffer, not a copy
    # every int64 field starts on 16 bytes (Triton specialises a kernel on its pointers' alignment)
    assert all((getattr(f, name).data_ptr() - buf.data_ptr()) % 16 == 0 for name in FIELDS if name not in
               ("seq_lens", "cu_seqlens_q"))


def test_step_buffer_without_pending_inputs():
    layout = StepLayout(num_tokens=1, batch_size=1, num_pending=0, num_logit_rows=1)
    buf = layout.pack(False, torch.tensor([6]), input_ids=[4], positions=[9], req_rows=[0], logit_rows=[0],
                      seq_lens=[10], cu_seqlens_q=[0, 1], pending_rows=[])
    f = layout.unpack(buf)
    assert f.pending_rows.numel() == 0 and f.out_cache_loc.tolist() == [6] and f.seq_lens.tolist() == [10]


def test_phase_timer_charges_every_phase_and_changes_no_token(tiny_model):
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [9, 14, 5], seed=61)
    want = [o.token_ids for o in make_llm(path).generate(prompts, greedy(6), use_tqdm=False)]
    llm = make_llm(path)
    timings = time_phases(llm.engine)
    got = [o.token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    assert got == want
    assert set(timings) == {"schedule", "metadata", "forward_extend", "forward_decode", "sampling", "postprocess"}
    assert all(v > 0 for v in timings.values())
