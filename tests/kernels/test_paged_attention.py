"""Paged attention (kernels/paged_attention.py): the torch reference equals scaled_dot_product_attention over
each sequence's keys laid out contiguously (the semantics, independent of the reference), and the Triton
kernel (compiled on a GPU, interpreted on CPU without one, as tests/conftest.py decides) equals the
reference in every phase: causal rows with and without a window, canvas rows, a ring of blocks with wrapped
positions, GQA groups 1, 2, 3, 4, head dims 16..512, ragged sequences, blocks out of order and interleaved.

Every slot of the pool that no row attends holds NaN (spare blocks too, and the table's unused entries point
at one): a kernel that reads a position outside its rows' intervals, or a wrong slot, returns NaN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# The kernel module (reference included) defines its kernel at import: Triton is needed (Linux x86-64 only).
pytest.importorskip("triton")

from dgcli.kernels.paged_attention import row_tiles, rows_per_tile  # noqa: E402
from dgcli.kernels.reference_ops import paged_attention_reference  # noqa: E402

# (dtype, atol, rtol): fp32 — only the order of the fp32 sums differs (the kernel's online softmax over key
# tiles, tl.dot's accumulation): a few ulps of O(1) values. bf16 — the reference rounds its fp32 result once;
# the interpreter's kernel computes in fp32 too, so an element may land one bf16 ulp away (2^-8 relative);
# compiled, the kernel also rounds the probabilities to bf16 for the P·V dot (2^-9 relative per term of a
# weighted mean of O(1) values), hence atol 1e-2.
TOLS = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-2, 2**-7)]


def causal(first: int, end: int, window: int = 0) -> list[tuple[int, int]]:
    """Prompt/commit rows at positions first..end-1: each attends itself and what precedes it (in the window)."""
    return [(max(0, p - window + 1) if window else 0, p + 1) for p in range(first, end)]


def canvas(n: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """n canvas rows of one sequence: all attend lo..hi-1."""
    return [(lo, hi)] * n


# name -> (n_heads, n_kv, head_dim, block_size, ring_blocks, [(cached positions, rows)] per sequence)
CASES = {
    # ragged: one decode-like row, 13 commit rows, a 20-row prompt from position 0; GQA 2
    "causal": (4, 2, 32, 16, 0, [(37, causal(36, 37)), (40, causal(27, 40)), (20, causal(0, 20))]),
    # sliding window 20: intervals start mid-block; GQA 1 (MHA); two rows of one sequence (one tile) whose
    # intervals leave a gap of NaN slots between them
    "window": (2, 2, 16, 16, 0, [(60, causal(36, 60, 20)), (9, causal(4, 9, 20)), (40, [(2, 6), (30, 40)])]),
    # canvas rows (one interval each sequence), commit rows then canvas rows in one sequence, a canvas whose
    # interval starts mid-block; GQA 4, block 32
    "canvas": (8, 2, 32, 32, 0, [(50, canvas(8, 0, 50)), (70, causal(38, 54) + canvas(16, 0, 70)),
                                 (75, canvas(5, 21, 75))]),
    # ring of 4 blocks of 16 (64 slots) under a window of 40: positions up to 149 wrap twice; a canvas in a
    # ring; a short sequence that never wraps
    "ring": (4, 2, 32, 16, 4, [(150, causal(130, 150, 40)), (90, canvas(6, 50, 90)), (30, causal(0, 30, 40))]),
    # GQA 3 (not a power of 2), head dim 24 (padded to 32), block 64, a 3-row sequence
    "gqa3": (6, 2, 24, 64, 0, [(70, causal(60, 70)), (3, canvas(3, 0, 3))]),
}
# The sliding layers' head dim and GQA with the largest block: a ring of 2 blocks of 256 under a window of 300
# (commit rows then a canvas, positions up to 699), and a sequence that has not wrapped yet.
SLIDING_256 = (4, 2, 256, 256, 2, [(700, causal(680, 692, 300) + canvas(8, 393, 700)), (200, causal(150, 200, 300))])


def make_case(n_heads, n_kv, d, block_size, ring_blocks, seqs, dtype, seed=0):
    """Random q and per-sequence keys/values, written into a pool whose blocks are shuffled and interleaved
    between the sequences. Returns (kernel args, logical [(k, v) [n_kv, P, d] per sequence])."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [ring_blocks or -(-p // block_size) for p, _ in seqs]
    spare = 2
    num_blocks = sum(per_seq) + spare
    # Interleave: logical block j of every sequence before block j + 1 of any, then shuffle the physical ids.
    order = [(s, j) for j in range(max(per_seq)) for s in range(len(seqs)) if j < per_seq[s]]
    phys = torch.randperm(num_blocks, generator=g)
    nan_block = int(phys[-1])  # a spare block: unused table entries point at NaNs
    tables = torch.full((len(seqs), max(per_seq) + 1), nan_block, dtype=torch.int32)
    for i, (s, j) in enumerate(order):
        tables[s, j] = phys[i]
    k_pool = torch.full((n_kv, num_blocks * block_size, d), float("nan"))
    v_pool = torch.full_like(k_pool, float("nan"))
    scale = 1.5 * d**-0.25  # scores ~ N(0, 2.25): a softmax neither flat nor one-hot
    logical, row_seq, row_lo, row_hi = [], [], [], []
    for s, (length, rows) in enumerate(seqs):
        k = (torch.randn(n_kv, length, d, generator=g) * scale).to(dtype).float()
        v = torch.randn(n_kv, length, d, generator=g).to(dtype).float()
        logical.append((k, v))
        attended = sorted({p for lo, hi in rows for p in range(lo, hi)})  # only these are written
        if ring_blocks:
            assert attended[0] >= length - ring_blocks * block_size, "the case's rows reach overwritten slots"
        pos = torch.tensor(attended)
        blk = pos // block_size % ring_blocks if ring_blocks else pos // block_size
        slot = tables[s].long()[blk] * block_size + pos % block_size
        k_pool[:, slot], v_pool[:, slot] = k[:, pos], v[:, pos]
        row_seq += [s] * len(rows)
        row_lo += [lo for lo, _ in rows]
        row_hi += [hi for _, hi in rows]
    n = len(row_seq)
    q = (torch.randn(n, n_heads, d, generator=g) * scale).to(dtype)
    ints = [torch.tensor(x, dtype=torch.int32) for x in (row_seq, row_lo, row_hi)]
    args = (q, k_pool.to(dtype), v_pool.to(dtype), *ints, tables, block_size, ring_blocks)
    return args, logical


def dense_oracle(q, row_seq, row_lo, row_hi, logical) -> torch.Tensor:
    """scaled_dot_product_attention (scale 1, GQA) per sequence over its contiguous keys, a boolean mask per
    row: fp32 [N, n_heads, d]."""
    out = torch.empty(q.shape)
    for s, (k, v) in enumerate(logical):
        idx = (row_seq == s).nonzero().flatten()
        pos = torch.arange(k.shape[1])
        mask = (pos >= row_lo[idx, None]) & (pos < row_hi[idx, None])  # [r, P]
        o = F.scaled_dot_product_attention(q[idx].float().transpose(0, 1)[None], k[None], v[None],
                                           attn_mask=mask, scale=1.0, enable_gqa=True)  # [1, H, r, d]
        out[idx] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_sdpa_on_contiguous_keys(name):
    args, logical = make_case(*CASES[name], torch.float32)
    got = paged_attention_reference(*args)
    assert got.shape == args[0].shape and not got.isnan().any()
    torch.testing.assert_close(got, dense_oracle(args[0], *args[3:6], logical), atol=1e-5, rtol=1e-5)


def _on(device, args):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference(name, dtype, atol, rtol, triton_device):
    from dgcli.kernels.paged_attention import paged_attention

    args, _ = make_case(*CASES[name], dtype)
    got = paged_attention(*_on(triton_device, args)).cpu()
    assert got.dtype == dtype and got.shape == args[0].shape
    torch.testing.assert_close(got, paged_attention_reference(*args), atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", ["ring", "gqa3"])
def test_kernel_small_blocks_and_given_tiles(name, triton_device, monkeypatch):
    """16x16 blocks: many key tiles per row, a group of 3 leaves a query slot unused; the tiles are given, one
    per sequence (larger than a block holds: the program walks it in chunks) plus empty padding tiles."""
    from dgcli.kernels import paged_attention as mod

    monkeypatch.setattr(mod, "TILES", {"bf16": {512: (16, 16, 4, 1, 1)}, "fp32": {512: (16, 16, 4, 1, 1)}})
    args, _ = make_case(*CASES[name], torch.float32, seed=1)
    counts = torch.unique_consecutive(args[3], return_counts=True)[1].tolist()
    n_heads, d, n_kv = args[0].shape[1], args[0].shape[2], args[1].shape[0]
    assert max(counts) > mod.rows_per_tile(n_heads, n_kv, d, torch.float32)
    t0, tn = row_tiles(counts, 10**6)
    t0, tn = torch.cat([t0, torch.zeros(3, dtype=torch.int32)]), torch.cat([tn, torch.zeros(3, dtype=torch.int32)])
    got = mod.paged_attention(*_on(triton_device, args), tile_row0=t0.to(triton_device), tile_rows=tn.to(triton_device))
    torch.testing.assert_close(got.cpu(), paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
def test_kernel_head_dim_512(dtype, atol, rtol, triton_device):
    """The full layers' shape: head dim 512, GQA 8 (16 query heads on 2 kv heads in the real model)."""
    from dgcli.kernels.paged_attention import paged_attention

    case = (8, 1, 512, 16, 0, [(40, causal(33, 40)), (25, canvas(3, 5, 25))])
    args, _ = make_case(*case, dtype)
    got = paged_attention(*_on(triton_device, args)).cpu()
    torch.testing.assert_close(got, paged_attention_reference(*args), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
def test_kernel_head_dim_256_block_256_ring(dtype, atol, rtol, triton_device):
    """The sliding layers' head dim with blocks of 256 in a ring; the reference against SDPA here too."""
    from dgcli.kernels.paged_attention import paged_attention

    args, logical = make_case(*SLIDING_256, dtype)
    got = paged_attention(*_on(triton_device, args)).cpu()
    want = paged_attention_reference(*args)
    torch.testing.assert_close(want.float(), dense_oracle(args[0], *args[3:6], logical), atol=atol, rtol=rtol)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("window", [0, 24])
def test_kernel_matches_sdpa_on_a_contiguous_cache(window, triton_device):
    """One sequence, blocks in order (the pool is the sequence's keys), causal rows: the kernel against
    scaled_dot_product_attention with its own causal/window mask."""
    from dgcli.kernels.paged_attention import paged_attention

    g = torch.Generator().manual_seed(3)
    n_heads, n_kv, d, bs, length = 4, 2, 32, 16, 64
    k = torch.randn(n_kv, length, d, generator=g) * 0.6
    v = torch.randn(n_kv, length, d, generator=g)
    q = torch.randn(length, n_heads, d, generator=g) * 0.6
    pos = torch.arange(length)
    lo = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= lo[:, None])  # [query, key]
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=1.0,
                                          enable_gqa=True)[0].transpose(0, 1)
    tables = torch.arange(length // bs, dtype=torch.int32)[None]
    ints = [t.to(torch.int32) for t in (torch.zeros_like(pos), lo, pos + 1)]
    got = paged_attention(*_on(triton_device, (q, k, v, *ints, tables)), bs)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_kernel_takes_a_query_view(triton_device):
    """The engine passes q as a transposed [n_heads, N, d] tensor (strides (d, N·d, 1)), not contiguous."""
    from dgcli.kernels.paged_attention import paged_attention

    args, _ = make_case(*CASES["canvas"], torch.bfloat16)
    dev = _on(triton_device, args)
    view = dev[0].transpose(0, 1).contiguous().transpose(0, 1)
    assert not view.is_contiguous()
    got = paged_attention(view, *dev[1:]).cpu()
    assert torch.equal(got, paged_attention(*dev).cpu())
    torch.testing.assert_close(got, paged_attention_reference(*args), atol=1e-2, rtol=2**-7)


def test_row_tiles_cut_each_sequence():
    t0, tn = row_tiles([1, 5, 0, 3], 2)
    assert t0.tolist() == [0, 1, 3, 5, 6, 8] and tn.tolist() == [1, 2, 2, 1, 2, 1]
    assert t0.dtype == torch.int32 and tn.dtype == torch.int32
    # the real model: sliding layers (16 heads on 8 kv, d 256) and full layers (16 on 2, d 512)
    assert rows_per_tile(16, 8, 256) == 32 and rows_per_tile(16, 2, 512) == 8


def test_kernel_rejects_mixed_dtypes_and_takes_no_rows():
    from dgcli.kernels.paged_attention import paged_attention

    args, _ = make_case(*CASES["window"], torch.float32)
    with pytest.raises(TypeError, match="all float32 or all bfloat16"):
        paged_attention(args[0].bfloat16(), *args[1:])
    empty = paged_attention(args[0][:0], args[1], args[2], *(t[:0] for t in args[3:6]), *args[6:])
    assert empty.shape == (0, *args[0].shape[1:])


class HostReads(TorchFunctionMode):
    """Fails on the torch calls that read a tensor's values on the host (each a device sync on CUDA)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.nonzero,
             torch.nonzero, torch.unique_consecutive, torch.Tensor.unique_consecutive}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"host read: {func.__name__}")
        return func(*args, **(kwargs or {}))


def test_kernel_reads_nothing_back_when_the_tiles_are_given(triton_device):
    """No value goes to the host with the tiles given (CUDA-graph capture); without them the function reads
    the row counts, which the check must see (so it can fail)."""
    from dgcli.kernels.paged_attention import paged_attention

    args, _ = make_case(*CASES["canvas"], torch.float32)
    counts = torch.unique_consecutive(args[3], return_counts=True)[1].tolist()
    n_heads, d, n_kv = args[0].shape[1], args[0].shape[2], args[1].shape[0]
    tiles = _on(triton_device, row_tiles(counts, rows_per_tile(n_heads, n_kv, d, torch.float32)))
    args = _on(triton_device, args)
    with HostReads():
        got = paged_attention(*args, tile_row0=tiles[0], tile_rows=tiles[1])
    with pytest.raises(AssertionError, match="host read"), HostReads():
        paged_attention(*args)
    torch.testing.assert_close(got.cpu(), paged_attention_reference(*_on("cpu", args)), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and torch's sync check need a GPU")
def test_kernel_captures_in_a_cuda_graph():
    """Compiled on a GPU: no sync under torch's sync check, and a captured launch replays new queries."""
    from dgcli.kernels.paged_attention import paged_attention

    args, _ = make_case(*CASES["ring"], torch.bfloat16)
    counts = torch.unique_consecutive(args[3], return_counts=True)[1].tolist()
    n_heads, d, n_kv = args[0].shape[1], args[0].shape[2], args[1].shape[0]
    tiles = _on("cuda", row_tiles(counts, rows_per_tile(n_heads, n_kv, d)))
    dev = _on("cuda", args)
    paged_attention(*dev, tile_row0=tiles[0], tile_rows=tiles[1])  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_attention(*dev, tile_row0=tiles[0], tile_rows=tiles[1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(*dev, tile_row0=tiles[0], tile_rows=tiles[1])
    new_q = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16) * 0.5
    dev[0].copy_(new_q.cuda())
    graph.replay()
    want = paged_attention_reference(new_q, *args[1:])
    torch.testing.assert_close(out.cpu(), want, atol=1e-2, rtol=2**-7)


@pytest.mark.parametrize("name", ["ring", "window", "causal"])
@pytest.mark.parametrize("dtype, atol, rtol", TOLS)
def test_fresh_keys_come_from_the_pass_not_the_cache(name, dtype, atol, rtol, triton_device):
    """A causal chunk's own positions read from k_new/v_new (rows of this pass), the cache holding NaN there
    (not written yet: the sliding layers' read-before-write): kernel and reference give the dense answer."""
    from dgcli.kernels.paged_attention import paged_attention

    n_heads, n_kv, d, bs, ring, seqs = CASES[name]
    args, logical = make_case(n_heads, n_kv, d, bs, ring, seqs, dtype)
    q, k_pool, v_pool, row_seq, row_lo, row_hi, tables = args[:7]
    n = q.shape[0]
    k_new = torch.full((n, n_kv, d), float("nan"), dtype=dtype)
    v_new = torch.full_like(k_new, float("nan"))
    fresh_pos = torch.full((n,), 1 << 30, dtype=torch.int32)
    fresh_row = torch.zeros(n, dtype=torch.int32)
    r0 = 0
    for s, (length, rows) in enumerate(seqs):
        his = [hi for _, hi in rows]
        if his == list(range(his[0], his[0] + len(rows))):  # a causal chunk: positions his[0]-1 .. length-1
            first = his[0] - 1
            k, v = logical[s]
            k_new[r0:r0 + len(rows)] = k[:, first:first + len(rows)].transpose(0, 1).to(dtype)
            v_new[r0:r0 + len(rows)] = v[:, first:first + len(rows)].transpose(0, 1).to(dtype)
            fresh_pos[r0:r0 + len(rows)], fresh_row[r0:r0 + len(rows)] = first, r0
            pos = torch.arange(first, first + len(rows))  # the cache does not hold them yet
            blk = pos // bs % ring if ring else pos // bs
            slot = tables[s].long()[blk] * bs + pos % bs
            k_pool[:, slot], v_pool[:, slot] = float("nan"), float("nan")
        r0 += len(rows)
    assert (fresh_pos < 1 << 30).any()
    want = dense_oracle(q, row_seq, row_lo, row_hi, logical)
    fresh = dict(k_new=k_new, v_new=v_new, fresh_pos=fresh_pos, fresh_row=fresh_row)
    ref = paged_attention_reference(q, k_pool, v_pool, row_seq, row_lo, row_hi, tables, bs, ring, **fresh)
    torch.testing.assert_close(ref.float(), want, atol=atol, rtol=rtol)
    counts = torch.unique_consecutive(row_seq, return_counts=True)[1].tolist()
    t0, tn = row_tiles(counts, rows_per_tile(n_heads, n_kv, d, dtype))
    dev = triton_device
    to = lambda t: t.to(dev)  # noqa: E731
    got = paged_attention(*map(to, (q, k_pool, v_pool, row_seq, row_lo, row_hi, tables)), bs, ring,
                          tile_row0=to(t0), tile_rows=to(tn), **{k: to(v) for k, v in fresh.items()})
    torch.testing.assert_close(got.float().cpu(), want, atol=atol, rtol=rtol)
