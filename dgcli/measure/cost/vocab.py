"""Peak memory of the vocabulary pass (head GEMM, softmax statistics, soft embedding and draw over b canvases) on
the CPU (kernels/vocab_pass_cpu.py, kernels/categorical.py) and on CUDA (kernels/vocab_pass.py), restating the
kernels' constants (tests/measure/test_memory.py keeps them equal and measures both peaks). Must not: import torch
or the kernels. Notation as in memory.py (V: the vocabulary).
"""

from __future__ import annotations

from dgcli.model.config import ModelConfig

GATHER_BYTES = 8 * 2**20  # kernels/categorical.py: the CPU draw's gathered embedding rows, per chunk
CPU_TILE_BYTES = 4 * 2**20  # kernels/vocab_pass_cpu.py: TILE_BYTES
CPU_TILE_ROWS = 256  # kernels/vocab_pass_cpu.py: TILE_ROWS (the tile width is auto_tile(TILE_ROWS, V))
CPU_SOFTMAX_BYTES = 4 * 2**20  # kernels/vocab_pass_cpu.py: SOFTMAX_BYTES (float32 [rows, V] per softmax call)
# kernels/vocab_pass.py (the tests read its text: it imports triton):
SCRATCH_BYTES = 512 * 2**20  # SCRATCH_BYTES: the bf16(L) scratch [rows, V] of one row chunk stays under it
VOCAB_SPLITS = 64  # VOCAB_SPLITS: the stats kernel's vocabulary splits ([splits, rows] statistics)
SOFT_SPLITS = 8  # SOFT_SPLITS: the soft GEMM's split-K ([splits, rows, H] fp32 partials)
SOFT_BLOCK_K = 64  # block_k's default: the soft GEMM's splits are whole BLOCK_K steps
GROUP = 64  # draw-statistics columns per group: vocab_pass_cpu.GROUP and vocab_pass_triton's block_n


def vocab_bytes(cfg: ModelConfig, b: int, ab: int = 2, cpu: bool = False) -> int:
    """The vocabulary pass's peak over N = b·C rows (its input hidden aside), the larger of its calls with the soft
    embedding (every step but a block's last) and without. CPU: one tile's buffers, the per-tile group sums kept
    for the draw, the soft accumulator, then the draw: float64 gsum, exp(gmax - top) and their product, then the
    mass and its cumsum while the chosen group's logits are recomputed from gathered embedding rows."""
    c, h, v = cfg.canvas_length, cfg.hidden_size, cfg.vocab_size
    n = b * c
    small = 64 * n  # a dozen [N] vectors: temperature, running max / sums / argmax, entropy, sample
    acc = 4 * n * h  # the soft embedding's fp32 accumulator [N, H]
    if cpu:
        tile = min(max(256, (CPU_TILE_BYTES // (4 * CPU_TILE_ROWS)) // 256 * 256), v)  # auto_tile(TILE_ROWS, V)
        width = GROUP if tile % GROUP == 0 else tile
        tiles, per_tile = -(-v // tile), -(-tile // width)
        groups = tiles * per_tile
        draws = 4 * n * (groups + tiles)  # the group sums [N, T/width] of the tiles so far, each tile's max
        if ab < 4:
            # Low precision: every tile's round(L) in one [N, V] buffer (ab) for the whole pass, written in
            # place; one tile: raw [N, T] (ab), L fp32, exp fp32. Then the softmax, r rows at a time (ab = 2
            # is taken as bf16: torch's bf16 softmax, its bf16 output only; fp16 would add an fp32 copy of the
            # rows and an fp32 output), then the GEMM's [N, H] and its scaled copy; the buffer goes before the
            # draw, the soft embedding [N, H] (ab) stays through it.
            stored = n * v * ab
            buffers = n * tile * (ab + 8)
            r = min(n, max(1, CPU_SOFTMAX_BYTES // (4 * v)))
            first = small + stored + 4 * n * per_tile + buffers
            last = small + stored + draws + buffers
            soft = small + stored + draws + max(ab * r * v, 2 * n * h * ab)
            kept = small + n * h * ab + draws + 8 * n * groups  # + torch.cat of gmax and gsum
        else:
            # fp32: one tile: raw [N, T], L, exp fp32 (the exp is the soft GEMM's weights), next to the group
            # sums and tile maxima, and from the second tile on acc and the tile's product [N, H].
            buffers = n * tile * (3 * ab + 12)
            first = small + 4 * n * per_tile + buffers
            last = small + 2 * acc + draws + buffers
            kept = small + acc + draws + 8 * n * groups  # + torch.cat of gmax and gsum
            soft = small + acc + draws + 8 * n * h  # acc / z, · scale
        stats = max(first, last if tiles > 1 else 0, soft)
    else:  # the Triton pass: its own formula (the draw's gather is one kernel there)
        return max(_cuda_vocab(n, h, v, ab, True), _cuda_vocab(n, h, v, ab, False))
    rows = min(n, max(1, GATHER_BYTES // (width * h * ab)))
    # group_logits: a chunk's gathered rows [r, W, H] (indexed by a clamped int64 copy of its columns), cols
    # int64 and L fp32 [N, W]; then p float64, its cumsum, p > 0 and the last column with mass [N, W].
    pick = max(rows * width * (h * ab + 8) + n * width * 12, n * width * 25)
    draw = max(kept + 24 * n * groups, kept + 16 * n * groups + pick)
    return max(stats, draw)


def _cuda_vocab(n: int, h: int, v: int, ab: int, want_soft: bool) -> int:
    """The Triton pass' peak over n rows: with the soft embedding in row chunks under the bf16(L) scratch's cap,
    without it all n at once."""
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)
    w = GROUP  # block_n: the draw's group width and the tile of the per-tile statistics
    tiles = cdiv(v, w)
    splits = cdiv(v, cdiv(cdiv(v, min(tiles, VOCAB_SPLITS)), w) * w)  # as _pass_rows rounds them to whole tiles
    soft_splits = cdiv(v, cdiv(cdiv(v, SOFT_SPLITS), SOFT_BLOCK_K) * SOFT_BLOCK_K)  # the soft GEMM's split-K
    small = 64 * n  # a dozen [N] vectors: temperature, uniforms, the outputs' sample / argmax / entropy
    out_row = 4 * h + 8 + 8 + 4  # what a chunk returns per row: fp32 soft sum [H], sample, argmax, entropy

    def chunk(r: int) -> int:
        # m, z, s, zb fp32 and amax int32 [splits, r]; tile_m, tile_z fp32 [r, V/W]; the bf16(L) scratch
        # [r, V]; _combine's mb, entropy, zbt fp32 and argmax int64 [r]
        base = 20 * splits * r + 8 * r * tiles + (r * v * ab if want_soft else 0) + 20 * r
        # the draw: gsum.double(), exp((gmax - top).double()) and their product [r, G] float64; then mass and
        # cum (float64) held while the chosen group's logits [r, W] fp32 become p (exp, float64), its cumsum,
        # p > 0 (bool), arange(W) and arange·(p > 0) (int64)
        draw = max(24 * r * tiles, 16 * r * tiles + 25 * r * w + 8 * w)
        soft = 4 * (soft_splits + 1) * r * h if want_soft else 0  # part [S, r, H] fp32 and acc = part[0].clone()
        return base + max(draw, soft)

    if not want_soft:  # one chunk of every row; the outputs are [N] vectors (small)
        return small + chunk(n)
    r = max(1, min(n, SCRATCH_BYTES // (v * ab)))  # rows per chunk: the bf16(L) scratch [r, V] under SCRATCH_BYTES
    full, rest = divmod(n, r)
    # earlier chunks' outputs are kept until the torch.cat: the last full chunk or the partial one peaks
    during = max(((full - 1) * r * out_row + chunk(r)), (full * r * out_row + chunk(rest)) if rest else 0)
    # after: the chunks' outputs, their concatenation, then soft = acc in the model dtype and its scaled copy
    outs = n * out_row * (2 if full + (rest > 0) > 1 else 1)
    return small + max(during, outs + n * h * (2 * ab if ab < 4 else ab))
