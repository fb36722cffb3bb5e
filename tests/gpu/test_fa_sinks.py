"""FlashAttention-3's `flash_attn_with_kvcache` with gpt-oss's options (learned sinks, a left window, GQA over pages)
on a CUDA GPU against the float64 attention of the CPU suite's FA3 stand-in (tests/helpers/fake_fa3.py), which
states the semantics the fa backend relies on: a sink joins each query row's softmax denominator as one more logit,
unscaled, with no value. Decode (one query a request) and ragged prefill rows, each with and without sinks and
window; this also checks the stand-in that the CPU suite trusts."""
from __future__ import annotations

import pytest
import torch

from ..helpers import fake_fa3
from .common import skip_unless_runs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HQ, HKV, D, PAGE = 8, 2, 64, 16
LENS = [40, 200, 7, 129]  # keys a request has, the new rows included


def _case(seed: int, new_rows):
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // PAGE) for n in LENS]
    num_pages = sum(pages_per) + 3
    k_cache = torch.randn(num_pages, PAGE, HKV, D, generator=g).bfloat16()
    v_cache = torch.randn(num_pages, PAGE, HKV, D, generator=g).bfloat16()
    order = torch.randperm(num_pages, generator=g).int()  # pages scattered over the pool
    table = torch.zeros(len(LENS), max(pages_per), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = order[at:at + n]
        at += n
    q = torch.randn(sum(new_rows), HQ, D, generator=g).bfloat16()
    sinks = (2.0 * torch.randn(HQ, generator=g)).bfloat16()
    return q, k_cache, v_cache, table, sinks


@pytest.mark.parametrize("sinks_on", [False, True])
@pytest.mark.parametrize("window", [-1, 31])
@pytest.mark.parametrize("prefill", [False, True])
def test_sinks_and_window_match_float64(prefill, window, sinks_on):
    skip_unless_runs("fa")
    from minisrv.attention.fa import load_kernel
    attn = load_kernel()
    new_rows = [min(n, r) for n, r in zip(LENS, [17, 64, 7, 1])] if prefill else [1] * len(LENS)
    q, k_cache, v_cache, table, sinks = _case(len(new_rows) + sum(new_rows), new_rows)
    cu = torch.tensor([0] + new_rows).cumsum(0).int()
    args = dict(cache_seqlens=torch.tensor(LENS, dtype=torch.int32), page_table=table, causal=True,
                softmax_scale=D ** -0.5, window_size=(window, 0), sinks=sinks if sinks_on else None)
    if prefill:
        args.update(cu_seqlens_q=cu, max_seqlen_q=max(new_rows))
        q_in = q
    else:
        q_in = q.view(len(LENS), 1, HQ, D)
    want = fake_fa3.flash_attn_with_kvcache(q_in, k_cache, v_cache, **args).float()
    dev = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    got = attn(q=q_in.cuda(), k_cache=k_cache.cuda(), v_cache=v_cache.cuda(), **dev).float().cpu()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 2e-2, f"prefill {prefill}, window {window}, sinks {sinks_on}: off by {err:.2e} of the largest output"
