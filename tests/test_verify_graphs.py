"""Verify steps through VerifyGraphs' padded layout, on the CPU: the graphs are "captured" as eager reruns into the
same output tensor, over a page-table backend written here with FA3's verify semantics (q queries per request,
causal from the bottom right of its length). The tokens are those of the run without speculation: the padding of
short drafts, the lengths and the row gathers are right."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from minisrv.engine.cuda_graph import VerifyGraphs

from .helpers import greedy, make_llm, make_prompts, vocab_of
from .test_speculative import SPEC, ReplayProposer, same


class PageTableVerify:
    """A verify step's attention as FA3 computes it: request b's q queries are the last q positions of its
    cache_seqlens[b] keys, read through its page table; query j sees keys 0..len - q + j."""

    def __init__(self, pool, req_to_token, num_q_heads: int) -> None:
        self.pool, self.req_to_token, self.page_size = pool, req_to_token, pool.page_size
        self.group = num_q_heads // pool.num_kv_heads
        self.scale = pool.head_dim ** -0.5

    def verify_meta(self, loc, table, seq_lens, q_len):
        return loc, table, seq_lens, q_len

    def kv_store_target(self, layer_id, meta):
        return None

    def forward(self, q, k, v, layer_id, meta):
        loc, table, seq_lens, q_len = meta
        self.pool.store(layer_id, loc, k, v)
        ps, out = self.page_size, []
        for b in range(table.shape[0]):
            n = int(seq_lens[b])
            pos = torch.arange(n)
            slots = table[b, pos // ps].long() * ps + pos % ps
            kk, vv = self.pool.load(layer_id, slots)  # [n, Hkv, D]
            qq = q[b * q_len:(b + 1) * q_len]  # [q, Hq, D]
            mask = pos[None, :] <= (n - q_len + torch.arange(q_len))[:, None]
            o = F.scaled_dot_product_attention(qq.transpose(0, 1), kk.repeat_interleave(self.group, 1).transpose(0, 1),
                                               vv.repeat_interleave(self.group, 1).transpose(0, 1), attn_mask=mask,
                                               scale=self.scale)
            out.append(o.transpose(0, 1))
        return torch.cat(out)


def eager_capture(run):
    """A "graph" whose replay reruns `run` into the first run's outputs (logits, and the layer inputs read or None)."""
    out = run()

    def replay():
        for o, new in zip(out, run()):
            if o is not None:
                o.copy_(new)
    return SimpleNamespace(replay=replay), out


def test_verify_steps_through_the_padded_graph_layout(tiny_model):
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [9, 17, 6], seed=12)
    params = greedy(26)
    plain = make_llm(path).generate(prompts, params, use_tqdm=False)
    llm = make_llm(path, page_size=4, **SPEC)
    eng, parts = llm.engine, llm.engine.parts
    eng.speculator.proposer = ReplayProposer({tuple(p): o.token_ids for p, o in zip(prompts, plain)},
                                             vocab_of(path), corrupt=0.3)
    backend = PageTableVerify(parts.pool, parts.table.table, parts.args.num_heads)
    pad_slot = parts.allocator.alloc(1)[0] * parts.page_size
    graphs = VerifyGraphs(eng.runner.model, backend, parts.table.table, pad_slot, [1, 2, 4], 5,
                          parts.table.table.shape[1], torch.device("cpu"))
    with torch.inference_mode():  # as CudaGraphRunner.capture runs
        graphs.capture(eager_capture)
    replays = []
    replay = graphs.replay
    graphs.replay = lambda fb: replays.append(fb.extend_lens_cpu) or replay(fb)
    eng.runner.graph_runner = SimpleNamespace(can_run=lambda fb: False, verify=graphs, max_bs=4)
    spec = llm.generate(prompts, params, use_tqdm=False)
    same(plain, spec)
    assert replays and any(len(set(ext)) > 1 for ext in replays)  # drafts of several lengths were padded
    assert any(len(ext) == 3 for ext in replays)  # a batch of 3 padded to the graph of 4
