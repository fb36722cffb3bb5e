"""The grammar mask op and the sampler, without a model: the constrained-decoding parameters are validated, the
mask op is checked against xgrammar's own CPU kernel and by hand, and the sampler's unmasked rows draw exactly
what they draw without a mask."""
from __future__ import annotations

import pytest
import torch

from minisrv import SamplingParams
from minisrv.engine.grammar import apply_bitmask
from minisrv.engine.grammar_check import check_grammar
from minisrv.engine.request import Request, RequestError
from minisrv.engine.sampler import SamplingBatch, sample


def test_sampling_params_validation():
    with pytest.raises(RequestError) as e:
        SamplingParams(json_schema="{}", regex="a")
    assert e.value.param == "regex" and "at most one" in str(e.value)
    with pytest.raises(RequestError) as e:
        SamplingParams(json_object=True, ebnf='root ::= "a"')
    assert e.value.param == "ebnf"
    with pytest.raises(RequestError) as e:
        SamplingParams(json_schema="{not json")
    assert e.value.param == "json_schema"
    with pytest.raises(RequestError) as e:
        SamplingParams(regex="")
    assert e.value.param == "regex"
    with pytest.raises(RequestError) as e:
        SamplingParams(json_object="yes")
    assert e.value.param == "json_object"
    SamplingParams(json_schema="{}")
    SamplingParams(json_schema='{"type": "object"}')
    check_grammar(SamplingParams(json_schema="{}"))
    check_grammar(SamplingParams())


@pytest.mark.parametrize("vocab,rows", [(100, None), (100, [0, 2]), (64, [1]), (1000, [3, 0])])
def test_apply_bitmask_matches_xgrammar_kernel(vocab, rows):
    import xgrammar as xgr
    g = torch.Generator().manual_seed(vocab)
    b = 4
    width = -(-vocab // 32)
    n = b if rows is None else len(rows)
    mask = torch.randint(-2 ** 31, 2 ** 31, (n, width), dtype=torch.int64, generator=g).to(torch.int32)
    logits = torch.randn(b, vocab, generator=g)
    before = logits.clone()
    ours = apply_bitmask(logits, mask, None if rows is None else torch.tensor(rows))
    assert torch.equal(logits, before)  # a new tensor: the raw logits are kept
    ref = logits.clone()
    full = torch.full((b, width), -1, dtype=torch.int32)  # xgrammar's kernel indexes the mask by logits row
    full[rows if rows is not None else slice(None)] = mask
    xgr.apply_token_bitmask_inplace(ref, full, vocab_size=vocab, indices=rows, backend="cpu")
    assert torch.equal(ours, ref)
    # and by hand: bit j of word w is token 32 w + j
    for k, row in enumerate(range(b) if rows is None else rows):
        allowed = [t for t in range(vocab) if (int(mask[k, t // 32]) >> (t % 32)) & 1]
        assert torch.isfinite(ours[row]).nonzero().flatten().tolist() == allowed


def _pack(tokens, vocab: int) -> torch.Tensor:
    """int32 words whose bit j of word w is set when token 32 w + j is in `tokens` (xgrammar's layout)."""
    words = [sum(1 << (t - 32 * w) for t in tokens if 32 * w <= t < 32 * (w + 1)) for w in range(-(-vocab // 32))]
    return torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in words], dtype=torch.int32)


def test_sampler_masks_only_its_rows():
    """Greedy and sampled rows with a mask draw only allowed tokens; rows without one draw exactly what they draw
    with no mask in the step (seeded); logprobs are of the raw logits."""
    vocab, b = 96, 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, vocab, generator=g) * 3
    allowed = {0: set(range(40, 50)), 3: {7, 70, 95}, 4: set(range(0, 96, 5))}
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=1.0, seed=1, logprobs=1), SamplingParams(temperature=1.0, seed=2, logprobs=1),
              SamplingParams(temperature=0.7, top_k=20, seed=3, logprobs=1),
              SamplingParams(temperature=1.3, seed=4, repetition_penalty=1.3, logprobs=1)]
    reqs = [Request([5, 6, 7], sp, 100) for sp in params]
    rows = sorted(allowed)
    mask = torch.stack([_pack(allowed[r], vocab) for r in rows])
    for step in range(20):
        for r in reqs:
            r.output_ids = [11] * step
        plain = sample(logits, SamplingBatch.build(reqs, torch.device("cpu")))
        sb = SamplingBatch.build(reqs, torch.device("cpu"))
        sb.grammar_mask, sb.grammar_rows = mask, torch.tensor(rows)
        raw = logits.clone()
        ids, lp, _ = sample(logits, sb)
        assert torch.equal(logits, raw)
        for i in range(b):
            if i in allowed:
                assert int(ids[i]) in allowed[i]
            else:
                assert int(ids[i]) == int(plain[0][i])
        assert int(ids[0]) == max(allowed[0], key=lambda t: logits[0, t].item())  # greedy: best allowed
        assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1))
