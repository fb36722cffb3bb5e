"""The KV pool's store: K and V side by side in a fused qkv output, stored with one scatter, end up as with two
separate writes."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("page_size", [1, 4])
def test_pool_store_of_adjacent_k_and_v_matches_separate_writes(page_size):
    """K and V that sit side by side in a fused qkv output are stored with one scatter; the pool must end up
    exactly as with two separate writes (and as with k/v that are not adjacent)."""
    from minisrv.kvcache import KVPool
    h, d, t = 2, 8, 5
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (3 + 2 * h) * d, generator=g)  # 3 q heads, then k, then v
    k = qkv[:, 3 * d:(3 + h) * d].view(t, h, d)
    v = qkv[:, (3 + h) * d:].view(t, h, d)
    loc = torch.tensor([7, 0, 13, 2, 9])
    pools = [KVPool(2, 16 // page_size, page_size, h, d, torch.float32, torch.device("cpu")) for _ in range(3)]
    pools[0].store(1, loc, k, v)  # adjacent: the fused path
    pools[1].store(1, loc, k.clone(), v.clone())  # separate tensors: two writes
    flat_k = pools[2].k[1].view(-1, h, d)
    flat_v = pools[2].v[1].view(-1, h, d)
    for i, s in enumerate(loc.tolist()):  # by hand
        flat_k[s] = k[i]
        flat_v[s] = v[i]
    for p in pools[:2]:
        assert torch.equal(p.k[1], pools[2].k[1]) and torch.equal(p.v[1], pools[2].v[1])
        assert not p.k[0].any() and not p.v[0].any()  # other layers untouched
    assert pools[0].v[1].view(-1, h, d)[7].equal(v[0]) and not pools[0].k[1].equal(pools[0].v[1])
