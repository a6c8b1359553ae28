"""The paged KV cache and the one attention path: allocation, where positions live, and passes whose results do
not depend on where a sequence's blocks are, on how its prompt was chunked, or on what else shares the pass."""

from __future__ import annotations

import pytest
import torch

from dgcli.model.attention import PassLayout, Segment
from dgcli.engine.block_manager import BlockPool
from dgcli.engine.kv_cache import PagedKVCache
from dgcli.checkpoint.random_weights import make_config, random_model
from hf_oracle import CONFIGS


@pytest.fixture(scope="module")
def model():
    text = {k: v for k, v in CONFIGS["gqa2_window6"].items() if k != "canvas"}
    return random_model(make_config(text, canvas_length=4), seed=0)


def test_block_pool_prefers_one_run_and_takes_back_what_it_gave():
    pool = BlockPool(8)
    a, b = pool.take(3), pool.take(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    pool.give(a)
    assert pool.free == [0, 1, 2, 5, 6, 7]
    assert pool.take(3) == [0, 1, 2]  # the first run that fits
    pool.give([0, 1, 2])
    assert pool.take(4) == [0, 1, 2, 5]  # no run of 4: the lowest ids
    assert pool.take(3) is None and pool.free == [6, 7]  # short: nothing taken


def test_positions_live_in_their_blocks_and_rings_wrap():
    cache = PagedKVCache([(1, 2, None), (1, 2, 10)], seqs=2, max_len=40, device="cpu", dtype=torch.float32,
                         block_size=4)
    assert cache.ring_blocks == 3  # W - 1 = 9 positions -> 3 blocks of 4
    assert cache.reserve(0, 10) and cache.reserve(1, 40)
    t = cache.tables
    assert len(t[0]["full"]) == 3 and len(t[1]["full"]) == 10 and len(t[1]["ring"]) == 3
    full = cache.slots("full", 1, 0, 40)
    assert full.tolist() == [t[1]["full"][p // 4] * 4 + p % 4 for p in range(40)]
    ring = cache.slots("ring", 1, 20, 29)  # 9 positions: all distinct slots in a ring of 12
    assert len(set(ring.tolist())) == 9
    assert cache.slots("ring", 1, 12, 13).tolist() == cache.slots("ring", 1, 0, 1).tolist()  # 12 = 0 mod 12
    assert cache.runs("full", 1, 0, 40) == [(t[1]["full"][0] * 4, t[1]["full"][0] * 4 + 40)]  # one run
    assert len(cache.runs("ring", 1, 10, 14)) == 2  # wraps at 12
    with pytest.raises(ValueError, match="positions"):
        cache.reserve(0, 41)
    cache.release(0)
    assert 0 not in cache.tables and cache.free_blocks() == {"full": 20 - 10, "ring": 6 - 3}
    assert cache.reserve(0, 40)  # the 10 free full blocks
    assert cache.free_blocks() == {"full": 0, "ring": 0} and not cache.reserve(2, 4)  # nothing left, nothing taken
    with pytest.raises(ValueError, match="already"):
        cache.reserve(1, 4)


def hidden_of(model, prompts, canvases, *, shuffle=False, chunk=None, budget_rows=None):
    """Each prompt encoded (in chunks of `chunk` ids, one pass per chunk, all rows together), then every canvas
    in one pass: [B, C, H]. `shuffle` hands the sequences' blocks out of order (a cache whose free list was
    scrambled)."""
    c = model.config.canvas_length
    max_len = max(len(p) for p in prompts) + c
    cache = model.new_cache(len(prompts), max_len, block_size=2)
    if shuffle:
        for pool in cache.groups.values():
            g = torch.Generator().manual_seed(5)
            pool.free = [pool.free[i] for i in torch.randperm(len(pool.free), generator=g).tolist()]
            pool.take = lambda n, pool=pool: [pool.free.pop() for _ in range(n)] if n <= len(pool.free) else None
    for s, p in enumerate(prompts):
        assert cache.reserve(s, len(p) + c)
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        segs, ids = [], []
        for s, p in enumerate(prompts):
            n = min(len(p) - done[s], chunk or len(p))
            if n:
                segs.append(Segment(s, done[s], n, False))
                ids.append(p[done[s]:done[s] + n])
                done[s] += n
        assert model.forward_pass(torch.cat(ids), segs, cache) is None
    segs = [Segment(s, len(p), c, True) for s, p in enumerate(prompts)]
    return model.forward_pass(canvases.flatten(), segs, cache), cache


def inputs(model, lens, seed=3):
    g = torch.Generator().manual_seed(seed)
    v, c = model.config.vocab_size, model.config.canvas_length
    return [torch.randint(0, v, (n,), generator=g) for n in lens], torch.randint(0, v, (len(lens), c), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_out_of_order_give_the_same_bits(model, dtype):
    m = model.to(dtype)
    prompts, canvases = inputs(m, [19, 7, 26])  # several windows long: the rings wrap
    with torch.inference_mode():
        want, _ = hidden_of(m, prompts, canvases)
        got, cache = hidden_of(m, prompts, canvases, shuffle=True)
    assert any(len(cache.runs("full", s, 0, 20)) > 1 for s in range(3))  # really scattered
    assert torch.equal(got, want)
    model.float()


def test_one_pass_equals_the_reference_formulation(model):
    """The mixed pass (prompts and canvases in one forward) against the no-cache unified formulation."""
    prompts, canvases = inputs(model, [13, 13])
    with torch.inference_mode():
        got = model.forward_canvas(torch.stack(prompts), canvases)
        want = model.logits(model.unified_hidden(torch.stack(prompts), canvases)[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_a_prompt_in_chunks_gives_the_whole_prompts_keys(model, chunk):
    prompts, canvases = inputs(model, [17, 4, 11])
    with torch.inference_mode():
        want, _ = hidden_of(model, prompts, canvases)
        got, _ = hidden_of(model, prompts, canvases, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same keys; SDPA's sums in other blocks


def test_a_canvas_does_not_depend_on_what_shares_its_pass(model):
    """Request 0's canvas alone, and beside request 1's prompt chunk and canvas in the same pass: the same bits
    in bf16 (each segment attends alone; every other op is row-wise)."""
    m = model.to(torch.bfloat16)
    c = m.config.canvas_length
    (p0, p1), canvases = inputs(m, [9, 12], seed=8)
    with torch.inference_mode():
        alone, _ = hidden_of(m, [p0], canvases[:1])
        cache = m.new_cache(2, 12 + c, block_size=2)
        cache.reserve(0, 9 + c), cache.reserve(1, 12 + c)
        m.forward_pass(p0, [Segment(0, 0, 9, False)], cache)
        m.forward_pass(p1[:5], [Segment(1, 0, 5, False)], cache)
        mixed = m.forward_pass(torch.cat((p1[5:], canvases[1], canvases[0])),
                               [Segment(1, 5, 7, False), Segment(1, 12, c, True), Segment(0, 9, c, True)], cache)
    assert torch.equal(mixed[1], alone[0])
    model.float()


def test_a_pass_reads_no_prefix_copy(model):
    """Every key read of a pass over consecutive blocks is a view of the pool (nothing concatenated)."""
    prompts, canvases = inputs(model, [30])
    c = model.config.canvas_length
    cache = model.new_cache(1, 30 + c, block_size=2)
    cache.reserve(0, 30 + c)
    layout = PassLayout([Segment(0, 30, c, True)], cache, torch.device("cpu"))
    for g, w in (("full", None), ("ring", 6)):
        runs, mask = layout.reads(0, g, w)
        assert mask is None and (len(runs) == 1 or g == "ring")  # a ring may wrap: two views (a copy of < W keys)
    with pytest.raises(ValueError, match="before canvas"):
        PassLayout([Segment(0, 30, c, True), Segment(0, 0, 3, False)], cache, torch.device("cpu"))


@pytest.mark.parametrize("chunk", [None, 3])
def test_the_triton_kernel_pass_equals_the_sdpa_pass(model, triton_device, monkeypatch, chunk):
    """The whole pass with attention through the paged Triton kernel (the interpreter on CPU, compiled on a GPU)
    against torch's SDPA path: blocks out of order, rings wrapped, prompts in chunks, fp32."""
    from dgcli.model import attention

    prompts, canvases = inputs(model, [19, 7, 26], seed=4)
    with torch.inference_mode():
        want, _ = hidden_of(model, prompts, canvases, shuffle=True, chunk=chunk)
        monkeypatch.setattr(attention, "backend", lambda device: "triton-paged")
        m = model.to(triton_device)
        got, _ = hidden_of(m, [p.to(triton_device) for p in prompts], canvases.to(triton_device), shuffle=True,
                           chunk=chunk)
    model.to("cpu")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_shaped_segments_share_an_sdpa_call_with_the_same_bits(model, dtype, monkeypatch):
    """On CPU the segments of one shape (rows, keys, mask) attend in one batched SDPA call: prompt chunks of one
    length at one start, canvases after equal prefixes (not next to each other in the pass: their rows are
    picked, then put back). Every hidden state equals the pass with one call per segment, bit for bit: SDPA's
    CPU result for one element of a batch is the element's alone."""
    from torch.nn import functional as F

    from dgcli.model import attention

    m = model.to(dtype)
    prompts, canvases = inputs(m, [9, 9, 13, 9], seed=6)  # several windows (W 6, blocks of 2): the rings wrap
    sdpa, batches = F.scaled_dot_product_attention, []

    def spy(q, *args, **kw):
        batches.append(q.shape[0])
        return sdpa(q, *args, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    with torch.inference_mode():
        got, _ = hidden_of(m, prompts, canvases, chunk=3, shuffle=True)
        batched = list(batches)
        monkeypatch.setattr(attention, "_batch_key", lambda s, lo, hi: (s.seq, s.canvas))  # a call per segment
        want, _ = hidden_of(m, prompts, canvases, chunk=3, shuffle=True)
    model.float()
    assert max(batched) == 4 and 3 in batched  # the 4 prompts' chunks; canvases 0, 1 and 3
    assert set(batches[len(batched):]) == {1}
    assert torch.equal(got, want)


def test_full_layers_batch_only_short_keys(model, monkeypatch):
    """A full layer's same-shaped segments share a call only while each one's keys take at most GATHER_BYTES
    (they are gathered: a copy); past it each reads its own views of the pool (no prefix copied). A sliding
    layer's are gathered whatever their length (ring keys: fewer than W)."""
    from dgcli.model import attention

    c, cpu = model.config.canvas_length, torch.device("cpu")
    cache = model.new_cache(2, 9 + c, block_size=2)
    assert cache.reserve(0, 9 + c) and cache.reserve(1, 9 + c)
    segs = [Segment(0, 9, c, True), Segment(1, 9, c, True)]
    kinds = model.config.layer_types
    full, sliding = kinds.index("full_attention"), kinds.index("sliding_attention")
    plan = PassLayout(segs, cache, cpu).sdpa_plan(full, None)
    assert [x.m for x in plan.calls] == [2] and plan.gather is not None
    monkeypatch.setattr(attention, "GATHER_BYTES", 0)
    layout = PassLayout(segs, cache, cpu)
    plan = layout.sdpa_plan(full, None)
    assert [x.m for x in plan.calls] == [1, 1] and plan.gather is None
    assert [x.keys for x in plan.calls] == [tuple(cache.runs("full", s, 0, 9 + c)) for s in (0, 1)]  # views
    assert [x.m for x in layout.sdpa_plan(sliding, True).calls] == [2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_rotate_half_formula_bit_for_bit(dtype):
    """`apply_rope` (the rotation's sign kept in the sin table: 4 ops, not 10) against the reference's
    x·cos + cat(-x2, x1)·sin, partial rotary included (zero frequencies: sin ±0), zeros and signs in x."""
    from dgcli.model.gemma import apply_rope, rope_tables

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, 16, generator=g).to(dtype)
    x[0, 0] = 0.0
    x[1, 1] = -x[1, 1].abs()
    inv_freq = torch.cat((1.0 / 10000 ** (torch.arange(0, 10, 2).float() / 16), torch.zeros(3)))  # 5 of 8 pairs
    pos = torch.tensor([0, 1, 5, 30, 400, 4095, 9])
    freqs = pos.float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    want = x * cos + torch.cat((-x[..., 8:], x[..., :8]), dim=-1) * sin
    got = apply_rope(x, *rope_tables(pos, inv_freq, dtype))
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
