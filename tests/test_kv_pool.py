"""The KV pool's store: K and V side by side in a fused qkv output, stored with one scatter, end up as with two
separate writes; a CPU pool takes memory only as it is written."""
from __future__ import annotations

import os

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


def test_cpu_kv_pool_takes_memory_as_it_is_written():
    """A CPU pool of 65,536 tokens (2.8 GiB for the default model) is not made resident at start: it reads as
    zeros, what is stored reads back, and resident memory grows by the pages written, not by the pool."""
    from minisrv.kvcache.pool import KVPool

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    pool = KVPool(30, 65536, 1, 3, 64, torch.float32, torch.device("cpu"))
    assert pool.nbytes > 2 << 30
    assert resident() - before < 64 << 20
    k, v = torch.randn(4, 3, 64), torch.randn(4, 3, 64)
    slots = torch.tensor([0, 1, 40000, 65535])
    pool.store(7, slots, k, v)
    got_k, got_v = pool.load(7, torch.tensor([0, 1, 40000, 65535, 5]))
    assert torch.equal(got_k[:4], k) and torch.equal(got_v[:4], v)
    assert not got_k[4].any() and not got_v[4].any()
    assert resident() - before < 64 << 20
