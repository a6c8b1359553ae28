"""Prefix caching in the paged cache: keys chained over whole blocks' ids, shared blocks counted per holder,
unheld keyed blocks cached until a reservation needs room (least recently released first), a block found
only for the same ids at the same positions, and a hit's keys equal to what encoding those blocks gives."""

from __future__ import annotations

import pytest
import torch

from dgcli.model.attention import Segment
from dgcli.engine.block_manager import pool_blocks
from dgcli.engine.kv_cache import PagedKVCache
from dgcli.checkpoint.random_weights import make_config, random_model
from hf_oracle import CONFIGS

B = 4


def cache(seqs=3, max_len=16):
    return PagedKVCache([(1, 2, None), (1, 2, 6)], seqs=seqs, max_len=max_len, device="cpu", dtype=torch.float32,
                        block_size=B, prefix_caching=True)


def test_sliding_blocks_are_held_within_the_window():
    """With prefix caching the sliding layers address block p // B (no ring) in a pool of their own, take blocks
    as a pass writes them (`hold`) and give back those wholly before a window's start (`trim`); the pool is
    sized for every sequence's window and one pass's rows (`pool_blocks`), not for every position."""
    c = cache()
    assert c.ring_blocks == c.full_blocks == 4 and c.groups["full"] is not c.groups["ring"]
    assert c.reserve(0, 10) and c.tables[0]["ring"] == [-1, -1, -1]  # nothing held until written
    c.hold(0, 0, 10)
    assert c.slots("ring", 0, 0, 10).tolist() == [c.tables[0]["ring"][p // B] * B + p % B for p in range(10)]
    first = c.tables[0]["ring"][0]
    c.trim(0, 9)  # reads from 9 - 5 = 4 on: block 0 (positions 0..3) is never read again
    assert c.tables[0]["ring"][0] == -1 and -1 not in c.tables[0]["ring"][1:] and first in c.groups["ring"].free
    c.trim(0, 8)  # (never back)
    assert c.tables[0]["ring"][1] != -1
    with pytest.raises(RuntimeError, match="not held"):
        c.slots("ring", 0, 2, 6)
    c.release(0)
    assert c.free_blocks() == {"full": 12, "ring": 12}
    plain = PagedKVCache([(1, 2, None), (1, 2, 6)], seqs=3, max_len=16, device="cpu", dtype=torch.float32,
                         block_size=B)
    assert plain.ring_blocks == 2 and plain.reserve(0, 10) and len(plain.tables[0]["ring"]) == 2  # rings as before
    plain.hold(0, 0, 10), plain.trim(0, 9)  # no-ops without prefix caching
    assert plain.free_blocks()["ring"] == 4
    # sizes: rings 2 blocks a sequence; windowed: (2 + 3) a sequence + one pass of 40 rows, at most every position
    assert pool_blocks([None, 6], seqs=3, max_len=16, block_size=B, prefix_caching=False) == (12, 6)
    assert pool_blocks([None, 6], seqs=3, max_len=64, block_size=B, prefix_caching=True, pass_rows=40) == (48, 25)
    assert pool_blocks([None, 6], seqs=3, max_len=16, block_size=B, prefix_caching=True, pass_rows=40) == (12, 12)
    big = PagedKVCache([(1, 2, None), (1, 2, 6)], seqs=3, max_len=64, device="cpu", dtype=torch.float32,
                       block_size=B, prefix_caching=True, pass_rows=40)
    assert big.groups["ring"].n == 25 and big.k[1].shape[1] == 25 * B


def written(c, seq, ids, lo=0):
    """A pass wrote sequence `seq`'s positions lo..len(ids)-1: hold its sliding blocks, key its whole blocks."""
    c.hold(seq, lo, len(ids))
    c.register(seq, ids)


def test_hits_are_whole_blocks_of_the_same_ids_at_the_same_positions():
    c = cache()
    ids = list(range(10, 21))  # 11 ids: 2 whole blocks and 3 ids of a third
    assert c.reserve(0, 12)
    written(c, 0, ids[:6])  # a pass wrote 6 positions: only block 0 is whole
    assert c.cached_blocks() == 1 and c.lookup(ids) == c.tables[0]["full"][:1]
    written(c, 0, ids, 6)
    assert c.cached_blocks() == 2 and c.lookup(ids) == c.tables[0]["full"][:2]  # the partial third never
    assert c.lookup(ids[:7]) == c.tables[0]["full"][:1]
    assert c.lookup(ids[:4] + [99] + ids[5:]) == c.tables[0]["full"][:1]  # one id differs in block 1
    assert c.lookup([99] + ids[1:]) == []  # block 0 differs: block 1's ids alone match nothing
    assert c.lookup(ids[4:8] + ids[:4]) == []  # the same ids at other positions
    assert c.lookup(ids[4:8]) == []  # block 1's ids at position 0


def test_a_hit_needs_the_sliding_blocks_of_its_last_window():
    """A hit of h blocks holds the sliding layers' blocks of its last W-1 positions (blocks (4h - 5) // 4 .. h-1
    here), not copies; where one of them was evicted the hit ends earlier, where they are all cached."""
    c = cache(seqs=2, max_len=16)
    ids = list(range(30, 42))
    assert c.reserve(0, 12)
    written(c, 0, ids)
    full, ring = c.tables[0]["full"], list(c.tables[0]["ring"])
    c.trim(0, 12)  # block 0 leaves the window: cached, not held
    assert c.tables[0]["ring"][0] == -1 and list(c.groups["ring"].lru) == [ring[0]]
    assert c.lookup(ids) == full and c.reserve(1, 16, shared=full)
    assert c.tables[1]["ring"] == [-1, ring[1], ring[2], -1]  # the hit's window: blocks 1, 2 shared
    assert [c.groups["ring"].refs[b] for b in ring] == [0, 2, 2]
    c.release(1), c.release(0)
    assert all(r == 0 for r in c.groups["ring"].refs) and c.free_blocks() == {"full": 8, "ring": 8}
    c = cache(seqs=2, max_len=16)
    assert c.reserve(0, 12)
    written(c, 0, ids)
    full = c.tables[0]["full"]
    c.release(0)  # tail first into the LRU: block 2's twin is evicted first
    pool = c.groups["ring"]
    pool.take(len(pool.free) + 1)
    assert c.lookup(ids) == full[:2]  # 3 blocks would need the twins of 1 and 2; 2 blocks need 0 and 1
    pool.take(1)
    assert c.lookup(ids) == full[:1]  # 2 blocks need 0 and 1 (gone); 1 needs 0


def test_refcounts_lru_and_eviction():
    c = cache(seqs=2, max_len=12)  # 6 blocks in all
    pool = c.groups["full"]
    a = list(range(100, 112))
    assert c.reserve(0, 12)
    written(c, 0, a)
    hit = c.lookup(a)
    assert len(hit) == 3 and c.reserve(1, 12, shared=hit[:2])  # shares 2, takes 1
    assert [pool.refs[b] for b in hit] == [2, 2, 1]
    c.release(0)
    assert [pool.refs[b] for b in hit] == [1, 1, 0] and list(pool.lru) == [hit[2]]  # cached, not free
    assert c.free_blocks()["full"] == 6 - 3 and c.lookup(a) == hit
    c.release(1)
    assert all(r == 0 for r in pool.refs) and c.tables == {} and c.free_blocks()["full"] == 6
    assert list(pool.lru) == [hit[2], hit[1], hit[0]]  # the chain's tail first: evicted before its parents
    assert c.reserve(0, 12)  # takes the 3 plain free blocks first: the cache keeps all 3
    assert c.lookup(a) == hit
    assert c.reserve(1, 4)  # one more: the oldest cached block (the tail) goes
    assert c.lookup(a) == hit[:2] and c.cached_blocks() == 2
    assert not c.reserve(2, 12)  # short: nothing taken, the cached blocks stay
    assert not c.reserve(2, 12, shared=hit[:2])  # short with a hit: the hit goes back to the cache
    assert c.lookup(a) == hit[:2] and c.free_blocks()["full"] == 2 and pool.refs[hit[0]] == pool.refs[hit[1]] == 0
    c.release(0), c.release(1)
    assert c.free_blocks()["full"] == 6 and all(r == 0 for r in pool.refs)


def test_a_second_writer_of_the_same_ids_keeps_one_key():
    """Two sequences encode the same prompt at once: the first registered block keeps the key, the second
    stays plain (freed, not cached, when it goes) and the chain goes on from the first."""
    c = cache()
    ids = list(range(12))
    assert c.reserve(0, 12) and c.reserve(1, 12)
    written(c, 0, ids[:8])
    written(c, 1, ids)  # blocks 0, 1 are 0's; block 2 hangs on 0's block 1
    assert c.cached_blocks() == 3 and c.lookup(ids) == c.tables[0]["full"][:2] + c.tables[1]["full"][2:]
    c.release(0), c.release(1)
    assert len(c.groups["full"].lru) == 3 and len(c.groups["full"].free) == 12 - 3


def test_a_hit_gives_the_bits_of_a_prompt_chunked_where_the_hit_ends():
    """Sequence 1 holds 2 blocks sequence 0 wrote (its first 32 ids, windows of 6 long exceeded) and encodes
    the rest: its canvas's hidden states equal, bit for bit in bf16, those of a plain cache whose prompt was
    encoded in two chunks split where the hit ends, also after sequence 1's sliding blocks before its window were
    given back and sequence 0 left (its blocks cached, the shared ones still held); and the layout of a prefix-
    caching cache alone (block p // B, no ring) changes no bit."""
    text = {k: v for k, v in CONFIGS["gqa2_window6"].items() if k != "canvas"}
    m = random_model(make_config(text, canvas_length=4), seed=0).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 96, (45,), generator=g)
    b = torch.cat([a[:32], torch.randint(0, 96, (18,), generator=g)])
    canvas = torch.randint(0, 96, (4,), generator=g)

    def plain(chunks, prefix_caching=False):
        kv = m.new_cache(1, 60, block_size=16, prefix_caching=prefix_caching)
        kv.reserve(0, 54)
        for lo, hi in chunks:
            kv.hold(0, lo, hi)
            m.forward_pass(b[lo:hi], [Segment(0, lo, hi - lo, False)], kv)
        return m.forward_pass(canvas, [Segment(0, 50, 4, True)], kv)

    with torch.inference_mode():
        kv = m.new_cache(2, 60, block_size=16, prefix_caching=True)
        kv.reserve(0, 49)
        kv.hold(0, 0, 45)
        m.forward_pass(a, [Segment(0, 0, 45, False)], kv)
        kv.register(0, a.tolist())
        hit = kv.lookup(b.tolist())
        assert len(hit) == 2 and kv.reserve(1, 54, shared=hit)
        assert kv.tables[1]["ring"][:2] == [-1, kv.tables[0]["ring"][1]]  # the hit's window: block 1 only
        kv.hold(1, 32, 50)
        m.forward_pass(b[32:], [Segment(1, 32, 18, False)], kv)
        want = plain([(0, 32), (32, 50)])
        assert torch.equal(m.forward_pass(canvas, [Segment(1, 50, 4, True)], kv), want)
        kv.trim(1, 50), kv.release(0)  # reads from 45 on: block 1 (16..31) goes back to sequence 0's holding
        assert kv.tables[1]["ring"][:3] == [-1, -1, kv.tables[1]["ring"][2]] and 0 not in kv.tables
        assert torch.equal(m.forward_pass(canvas, [Segment(1, 50, 4, True)], kv), want)
        assert torch.equal(plain([(0, 50)], True), plain([(0, 50)]))


def test_the_triton_kernel_reads_shared_blocks_and_long_rings(triton_device, monkeypatch):
    """The paged Triton kernel (interpreted on CPU, compiled on a GPU) over a prefix-caching cache: a sequence
    holding another's blocks (windows of 6 exceeded, so the long rings are read past their first block) gives
    SDPA's hidden states, fp32."""
    from dgcli.model import attention

    text = {k: v for k, v in CONFIGS["gqa2_window6"].items() if k != "canvas"}
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 96, (37,), generator=g)
    b = torch.cat([a[:32], torch.randint(0, 96, (9,), generator=g)])
    canvas = torch.randint(0, 96, (4,), generator=g)

    def hit_pass(device):
        m = random_model(make_config(text, canvas_length=4), seed=0).to(device)
        kv = m.new_cache(2, 48, block_size=8, prefix_caching=True)
        with torch.inference_mode():
            kv.reserve(0, 41)
            kv.hold(0, 0, 37)
            m.forward_pass(a.to(device), [Segment(0, 0, 37, False)], kv)
            kv.register(0, a.tolist())
            hit = kv.lookup(b.tolist())
            assert len(hit) == 4 and kv.reserve(1, 45, shared=hit)
            kv.hold(1, 32, 41), kv.trim(1, 32)  # the window from 27 on: blocks 3, 4, 5 (of 8 positions)
            m.forward_pass(b[32:].to(device), [Segment(1, 32, 9, False)], kv)
            kv.trim(1, 41)
            return m.forward_pass(canvas.to(device), [Segment(1, 41, 4, True)], kv).cpu()

    want = hit_pass("cpu")
    monkeypatch.setattr(attention, "backend", lambda device: "triton-paged")
    torch.testing.assert_close(hit_pass(triton_device), want, rtol=1e-5, atol=1e-5)
