"""Memory of a batched run: what one slot (row) of `generate_batch_events` costs, what is fixed, and the
largest batch that fits a memory budget.

Owns: `weights_bytes` (bf16, or FP8 as an FP8 checkpoint would store it), `loop_state_bytes` (what the
loop holds per row between passes), `step_bytes` (a denoising step's temporaries for b rows),
`peak_bytes` (the whole for b rows), `largest_batch`, and `batch_memory` / `markdown`, the section
`dgemma info` prints. Must not: run the model, allocate tensors, or import torch.

Every term is a buffer of the code, named where it is counted (the tests measure them: the KV cache
against `model.new_cache`, the loop state against a batched run's own tensors, a step's temporaries
against the CPU allocator's peak). Notation: b rows, C canvas, T = b·C tokens, H hidden, V vocabulary,
I dense width, Im expert width, k experts per token, S stability_threshold, ab the model dtype's bytes
(weights, activations and KV; an FP8 checkpoint keeps bf16 activations and KV).

The run holds one KV cache of b slots for its whole length (loop.py: `model.new_cache(slots, ...)` sized
for the longest request, prompt + every block but the last; a request joins by encoding its prompt into
a free slot and leaves by freeing it: nothing is copied); per slot, full layers keep every position and
sliding layers a ring of their last W-1 (`kv_bytes`). The peak of b slots = weights + b·KV +
b·(loop state) + the larger of what is live on top of that at once:
* a denoising step (rules.denoise_step): the decoder pass, then the vocabulary pass next to its input;
  a commit's encoder pass holds less than the decoder pass (the same layers over C tokens without the
  self-conditioning MLP, its keys read from the cache instead of concatenated with the canvas');
* the prefill: b prompts of --prompt-len tokens encoded at once (a later join encodes fewer).
Not counted: the CUDA context and the caching allocator's fragmentation (that is the headroom, 10 % of
the budget by default), torch.compile's buffers, the CPU flash-attention kernel's per-thread scratch
(a few hundred KiB per thread), the prompts' ids (8 bytes per token of every request, queued or not), the
Triton autotuner's buffers while it times the soft kernel (the first call of each row count: a warm-up).
"""

from __future__ import annotations

from dgcli.measure.card import DTYPE_BYTES, param_counts, quantized_counts
from dgcli.model.config import ModelConfig

GIB = 2**30
HEADROOM = 0.10  # of the budget: CUDA context (~0.5 GiB) and the caching allocator's fragmentation
# (name, bytes): the GPUs' nominal memory (NVIDIA's "80 GB" and "141 GB" are ~GiB: nvidia-smi shows
# 81,559 MiB and 143,771 MiB).
GPUS = (("H100 80 GB", 80 * GIB), ("H200 141 GB", 141 * GIB))
FORMATS = ("bf16", "fp8")
ACT_BYTES = {"bf16": 2, "fp8": 2, "fp32": 4}  # activations and KV of a run with these weights
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
MOE_BLOCK = 64  # kernels/moe.py: experts_triton's block_m (each expert's rows padded to it)


def cache_length(prompt_len: int, blocks: int, canvas: int) -> int:
    """Cached positions of a request: its prompt and every block but the last (loop.py sizes the cache
    `n + (num_blocks - 1) * c`: a row's last block is never encoded)."""
    return prompt_len + (blocks - 1) * canvas


def kv_bytes(cfg: ModelConfig, context: int, ab: int = 2) -> dict:
    """One slot's KV cache sized for `context` positions, as `model.new_cache` allocates it (model/cache.py):
    K and V of every position on full layers (`full_per_token` bytes a position), a ring of the last
    min(W-1, context) positions on sliding layers (`rings`, fixed per slot); `was_per_token` and `was`:
    the every-position buffers of every layer that the rings replaced."""
    row = [2 * g.num_kv_heads * g.head_dim * ab for g in cfg.layers]  # K and V of one position
    full = sum(r for r, g in zip(row, cfg.layers) if g.window is None)
    rings = sum(r * min(g.window - 1, context) for r, g in zip(row, cfg.layers) if g.window is not None)
    return {"context": context, "full_per_token": full, "rings": rings, "total": full * context + rings,
            "was_per_token": sum(row), "was": sum(row) * context}


def weights_bytes(cfg: ModelConfig, fmt: str = "bf16") -> dict:
    """Weights in `fmt`. bf16: 2 bytes per parameter (layer scalars fp32); fp32: 4. fp8: what dgemma holds for
    an FP8-dynamic checkpoint (`dgemma quantize --fp8`): the big matmul weights at 1 byte (attention q/k/v/o
    projections, dense MLP, experts) plus one bf16 scale per output channel (card.quantized_counts), and in
    bf16 what such checkpoints keep unquantized: the embedding (also the tied LM head), router,
    self-conditioning MLP, every norm gain (q_norm/k_norm included); the layer scalars fp32."""
    if fmt not in ACT_BYTES:
        raise ValueError(f"weight format {fmt!r}: use one of {tuple(ACT_BYTES)}")
    n = param_counts(cfg)
    if fmt == "fp32":  # a float32 run (random checkpoints, the bundled model)
        return {"format": fmt, "bytes": 4 * n["total"], "fp8_parameters": 0, "bf16_parameters": 0}
    fp8, scales = quantized_counts(cfg) if fmt == "fp8" else (0, 0)
    bf16 = n["total"] - n["layer_scalars"] - fp8
    return {"format": fmt, "bytes": fp8 + 2 * (bf16 + scales) + 4 * n["layer_scalars"], "fp8_parameters": fp8,
            "bf16_parameters": bf16}


def loop_state_bytes(cfg: ModelConfig, ab: int = 2, stability: int = 1) -> dict:
    """Per row, what the engine (`dgcli.sampling.engine.Engine`) holds during a decoder pass (its tensors
    are [b, ...]; a prefill leaves nothing behind):"""
    c, h = cfg.canvas_length, cfg.hidden_size
    parts = {
        "soft": c * h * ab,  # soft [b, C, H] (= out.soft): the self-conditioning input of the next pass
        "canvas": 8 * c,  # canvas [b, C] int64 (= next_canvas)
        "history": 8 * stability * c,  # history [S, b, C] int64 (rules.push_history)
        "last_step": c * (8 + 8 + 4 + 1),  # out.sample, out.argmax int64, out.entropy fp32, accepted bool
        # uniform f64, noise int64 [b, C]; step_k, seed_k, block_k, temp, stop [b]; RowRules' [b] tensors
        # (entropy bound, confidence threshold fp32, stability int64) when the rows' settings differ
        "draws": c * (8 + 8) + 3 * 8 + 4 + 1 + 16,
    }
    parts["total"] = sum(parts.values())
    return parts


def _norm(t: int, width: int, ab: int, cpu: bool) -> int:
    """The peak of an RMSNorm over [t, width], its output included: reference_ops.rms_norm_reference (CPU)
    holds two fp32 copies at once (y and y·r; the output is cast when one is left); the Triton kernel
    (CUDA) allocates only its output."""
    return max(8, 4 + ab) * t * width if cpu else ab * t * width


def decode_bytes(cfg: ModelConfig, b: int, context: int, ab: int = 2, cpu: bool = False,
                 prefill: int | None = None) -> int:
    """What the decoder pass (gemma.decode) allocates at its peak over b rows with `context` cached
    positions, the larger of its two ways: rows of one length in slot order attend together (their
    [cache | canvas] K and V concatenated at once), otherwise each row alone (its own K and V, the
    outputs collected in `parts` and concatenated). `prefill` = P: the encoder pass over b prompts of P
    tokens into their slots instead (gemma.encode: the slots' K and V read back as a copy, a causal mask
    [P, P], no feed-forward in the last layer).
    Per layer the loop keeps the previous layer's q, k, v and SDPA output (and `parts`) bound until
    reassigned; SDPA is a fused kernel (flash / memory-efficient on CUDA, the flash kernel on CPU: no
    score matrix, its output [b, T, n, d]-major, so the reshape before o_proj is a view); experts as the
    dispatched kernel runs them (moe_cpu.experts_segments, moe.experts_triton)."""
    if prefill is not None:
        return _pass_bytes(cfg, b, context, ab, cpu, prefill, False)
    return max(_pass_bytes(cfg, b, context, ab, cpu, None, False), _pass_bytes(cfg, b, context, ab, cpu, None, True))


def _pass_bytes(cfg: ModelConfig, b: int, context: int, ab: int, cpu: bool, prefill: int | None,
                per_row: bool) -> int:
    c = cfg.canvas_length if prefill is None else prefill  # tokens per row in this pass
    h, n, k = cfg.hidden_size, cfg.num_attention_heads, cfg.top_k_experts
    t, e, im, i_d = b * c, cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    x = t * h * ab  # the residual [T, H] (and every [T, H] activation)
    nh = _norm(t, h, ab, cpu)
    # RoPE tables cos, sin [tokens, d] per layer kind: one set for rows of one length, else one per row.
    tables = (b if per_row else 1) * sum(2 * c * d * ab for d in {g.head_dim for g in cfg.layers})
    # Prologue: embed(ids) and its scaled copy; the decoder then runs condition's MLP over the soft embedding
    # (pre_norm(soft), then gelu(gate), up and their product [T, sc]).
    peak = 2 * x if prefill else max(2 * x, x + nh, 2 * x + 3 * t * cfg.self_conditioning_size * ab)
    carry = prev_out = 0  # the previous layer's q, k, v and SDPA output (bound until reassigned); its output
    for i, g in enumerate(cfg.layers):
        qd, kvd = n * g.head_dim, g.num_kv_heads * g.head_dim
        q, kv = t * qd * ab, t * kvd * ab
        raw = kv * (2 if g.has_v_proj else 1)  # k_proj (and v_proj) outputs; K = V layers share k_raw
        ln = x + carry + x  # x, the previous layer's tensors, input_layernorm(x)
        # project: q_proj -> q_norm -> apply_rope (5 live: input, rotated, x·cos, rotated·sin, sum), then
        # k the same with k_raw (and v_raw) kept, then v_norm.
        peak = max(peak, x + carry + nh, ln + max(q + _norm(t, qd, ab, cpu), 5 * q),
                   ln + q + raw + max(_norm(t, kvd, ab, cpu), 5 * kv), ln + q + kv + raw + _norm(t, kvd, ab, cpu))
        qkv = q + 2 * kv
        lse = (1 if per_row else b) * n * c * 4  # SDPA's fp32 log-sum-exp
        if prefill:  # the slots' K, V read back [b, n_kv, P, d]; _causal's bool [P, P] x3 and SDPA's float copy;
            # a sliding layer's keys and values concatenated (ring prefix + the pass's own, here none): a copy
            attend = 2 * b * c * kvd * ab * (2 if g.window else 1) + c * c * ((3 if g.window else 1) + ab) + q + lse
        else:
            keys = (context if g.window is None else min(context, g.window - 1)) + c
            # together: torch.cat((pk, k)) and (pv, v) [b, n_kv, keys, d] and the output; alone: one row's
            # K and V next to the collected outputs (q's size), then their concatenation
            attend = max(2 * keys * kvd * ab + q + lse, 2 * q) if per_row else 2 * b * keys * kvd * ab + q + lse
        peak = max(peak, x + prev_out + qkv + attend)
        out = 2 * q if per_row and not prefill else q  # the SDPA output (and `parts`)
        base = x + qkv + out  # x, q, k, v, out
        # attn.out: o_proj [T, H], post_attention_layernorm, x + ...
        peak = max(peak, base + x + nh, base + 2 * x)
        carry, prev_out = qkv + out, q
        if prefill and i == len(cfg.layers) - 1:
            return tables + peak  # the encoder's last layer has no feed-forward (its output is only K/V)
        # Feed-forward: dense MLP (pre-norm, then gelu(gate), up and their product; post-norm), router
        # (norm, ·scale, ·root; logits and fp32 softmax [T, E]), then experts next to the dense output.
        peak = max(peak, base + nh, base + x + 3 * t * i_d * ab, base + x + nh, base + 3 * x,
                   base + 2 * x + t * e * (ab + 4))
        tk = t * k
        xn = base + x + tk * (4 + 8)  # + dense out, routing w fp32 / idx int64 [T, k]
        if cpu:  # moe_cpu.experts_segments: gather, gate_up, act, y, pairs, then _combine's fp32 copy and product
            ints = tk * (8 + 8 + 4 + 8)  # idx_sorted, perm, w_sorted, order
            moe = max(tk * (h + 2 * im) * ab, tk * 4 * im * ab, tk * ((3 * im + 2 * h) * ab + 8 * h)) + ints
        else:  # moe.experts_triton: act [slots, Im] (each expert padded to MOE_BLOCK), y [T·k, H], out [T, H]
            slots = -(-(tk + e * (MOE_BLOCK - 1)) // MOE_BLOCK) * MOE_BLOCK
            moe = slots * (im * ab + 4) + tk * h * ab + x + tk * (8 + 8 + 4)
        # pre_feedforward_layernorm_2, the experts over its output, then the post-norms and the sums
        peak = max(peak, xn + nh, xn + x + moe, base + 2 * x + nh, base + 3 * x)
    return tables + max(peak, x + carry + nh)  # epilogue: the final norm


def vocab_bytes(cfg: ModelConfig, b: int, ab: int = 2, cpu: bool = False) -> int:
    """What the vocabulary pass allocates at its peak over N = b·C rows (its input, hidden [N, H], is
    the decoder's output), the larger of its two calls: with the soft embedding (every step but a block's
    last) and without. CUDA (kernels/vocab_pass.py): rows in chunks of `_cuda_chunk_rows` (the bf16(L)
    scratch's cap) with the soft embedding, all N at once without; per chunk the splits' statistics, the
    draw's per-tile statistics, then the draw, then the soft GEMM's split-K partials (`_cuda_vocab`).
    CPU (kernels/vocab_pass_cpu.py, with the soft embedding): one tile's buffers, the per-tile group sums
    kept for the draw, the soft accumulator, then the draw. The draw (kernels/categorical.py): float64
    gsum, exp(gmax - top) and their product (3 x 8 bytes per group), then the mass and its cumsum while
    the chosen group's logits are recomputed (CPU: from gathered embedding rows, chunks of GATHER_BYTES;
    CUDA: one kernel writing [rows, W] fp32)."""
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


def _cuda_chunk_rows(n: int, v: int, ab: int) -> int:
    """Rows per chunk of the Triton pass with the soft embedding: as many as keep the bf16(L) scratch
    [rows, V] (model dtype) under SCRATCH_BYTES (vocab_pass_triton's `step`)."""
    return max(1, min(n, SCRATCH_BYTES // (v * ab)))


def _cuda_vocab(n: int, h: int, v: int, ab: int, want_soft: bool) -> int:
    """The Triton pass' peak over n rows (kernels/vocab_pass.py: vocab_pass_triton, _pass_rows; the draw in
    kernels/categorical.py with `_group_logits`), `ab` the embedding's bytes."""
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
    r = _cuda_chunk_rows(n, v, ab)
    full, rest = divmod(n, r)
    # every earlier chunk's outputs are kept in a list until the torch.cat: the last full chunk and the
    # partial one after it are the candidates for the loop's peak
    during = max(((full - 1) * r * out_row + chunk(r)), (full * r * out_row + chunk(rest)) if rest else 0)
    # after the loop: the chunks' outputs, their concatenation (more than one chunk), then soft = acc in the
    # model dtype (a copy unless fp32) and its scaled copy
    outs = n * out_row * (2 if full + (rest > 0) > 1 else 1)
    return small + max(during, outs + n * h * (2 * ab if ab < 4 else ab))


def step_bytes(cfg: ModelConfig, b: int, context: int, ab: int = 2, cpu: bool = False) -> dict:
    """A denoising step's temporaries for b rows (rules.denoise_step): the decoder pass, then the vocabulary
    pass next to its input hidden [b, C, H]; the step holds the larger. The accept / renoise / history
    work after them is tens of bytes per position, below either."""
    dec = decode_bytes(cfg, b, context, ab, cpu)
    voc = b * cfg.canvas_length * cfg.hidden_size * ab + vocab_bytes(cfg, b, ab, cpu)
    return {"decode": dec, "vocab_pass": voc, "total": max(dec, voc)}


def peak_bytes(cfg: ModelConfig, b: int, *, context: int, prompt_len: int = 256, fmt: str = "bf16",
               ab: int = 2, cpu: bool = False, stability: int = 1) -> dict:
    """The most memory b slots hold at once (see the module's docstring), by part."""
    weights = weights_bytes(cfg, fmt)["bytes"]
    kv = b * kv_bytes(cfg, context, ab)["total"]
    state = b * loop_state_bytes(cfg, ab, stability)["total"]
    phases = {"step": step_bytes(cfg, b, context, ab, cpu)["total"],
              "prefill": decode_bytes(cfg, b, context, ab, cpu, prefill=prompt_len)}
    top = max(phases, key=phases.get)
    return {"weights": weights, "kv_cache": kv, "loop_state": state, "phases": phases, "peak_phase": top,
            "total": weights + kv + state + phases[top]}


def largest_batch(cfg: ModelConfig, budget: int, *, headroom: float = HEADROOM, limit: int = 1 << 20,
                  **kw) -> int:
    """The largest b whose `peak_bytes` fits budget·(1 - headroom) (0: not even one row). peak_bytes grows
    with b, so a bisection finds the boundary: b fits and b + 1 does not."""
    usable = budget * (1.0 - headroom)
    if peak_bytes(cfg, 1, **kw)["total"] > usable:
        return 0
    lo, hi = 1, 2
    while hi < limit and peak_bytes(cfg, hi, **kw)["total"] <= usable:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak_bytes(cfg, mid, **kw)["total"] <= usable else (lo, mid)
    return lo


def step_per_row(cfg: ModelConfig, context: int, ab: int = 2, cpu: bool = False) -> float:
    """A step's temporaries per extra row in large batches (the slope between 64 and 128 rows: the
    per-chunk buffers, fixed in size, drop out)."""
    return (step_bytes(cfg, 128, context, ab, cpu)["total"] - step_bytes(cfg, 64, context, ab, cpu)["total"]) / 64


def batch_memory(cfg: ModelConfig, *, context: int, prompt_len: int, dtype: str, budgets: list[dict],
                 headroom: float = HEADROOM, stability: int = 1) -> dict:
    """The card's batch-memory section: per-slot bytes at `context` cached tokens (the card's run dtype),
    and for each budget ({"name", "bytes", "cpu"}) and weight format (bf16 activations and KV) the
    largest batch that fits."""
    ab = DTYPE_BYTES[dtype]
    kv = kv_bytes(cfg, context, ab)
    state = loop_state_bytes(cfg, ab, stability)
    step = {"cuda": step_per_row(cfg, context, ab), "cpu": step_per_row(cfg, context, ab, cpu=True)}
    fits = []
    formats = FORMATS + (("fp32",) if dtype == "float32" else ())
    for bud in budgets:
        usable = int(bud["bytes"] * (1 - headroom))
        for fmt in formats:
            kw = {"context": context, "prompt_len": prompt_len, "fmt": fmt, "ab": ACT_BYTES[fmt], "cpu": bud["cpu"],
                  "stability": stability}
            most = largest_batch(cfg, bud["bytes"], headroom=headroom, **kw)
            w = weights_bytes(cfg, fmt)["bytes"]
            fits.append({"memory": bud["name"], "memory_bytes": bud["bytes"], "path": "cpu" if bud["cpu"] else "cuda",
                         "weights": fmt, "weights_bytes": w, "usable_bytes": usable, "largest_batch": most,
                         "peak_phase": peak_bytes(cfg, most, **kw)["peak_phase"] if most else
                         "weights" if w > usable else "one_slot"})
    return {
        "context": context, "dtype": dtype, "headroom": headroom,
        "per_slot": {"kv_cache": kv["total"], "kv": kv, "loop_state": state["total"], "loop_state_parts": state,
                     "step_per_row": step, "total": {p: kv["total"] + state["total"] + s for p, s in step.items()}},
        "weights": {fmt: weights_bytes(cfg, fmt) for fmt in formats},
        "fits": fits,
        "assumptions": (
            f"peak = weights + b x (KV: full layers every position, sliding layers a ring of their last window-1; "
            f"+ sampler state) + the larger of a denoising step's temporaries and "
            f"the prefill's (b prompts of {prompt_len} tokens); usable = memory less {headroom:.0%} headroom "
            f"(CUDA context, allocator fragmentation); bf16 activations and KV (fp32 for fp32); FP8 = attention, MLP and "
            f"expert matrices at 1 byte/param + a bf16 scale per output channel, embedding/LM head, router, self-conditioning MLP and norms "
            f"bf16 (as dgemma holds an FP8-dynamic checkpoint: `dgemma quantize --fp8`)."),
    }


def _b(n: float) -> str:
    """Bytes in binary units, 3-4 significant digits."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


_PHASES = {"step": "a step", "prefill": "the prefill", "weights": "weights alone exceed it",
           "one_slot": "one slot does not fit"}


def markdown(sec: dict) -> str:
    """The section as `dgemma info` prints it."""
    ps, w = sec["per_slot"], sec["weights"]
    st, kv = ps["loop_state_parts"], ps["kv"]
    lines = [(f"**batch memory** ({sec['dtype']} KV, {sec['context']:,} cached tokens per slot = the longest "
              f"request's prompt + every block but the last; --context):"),
             (f"- per slot: KV cache {_b(ps['kv_cache'])} + sampler state {_b(ps['loop_state'])} (soft embedding "
              f"{_b(st['soft'])}, canvas, history, last step's outputs) + step temporaries "
              f"{_b(ps['step_per_row']['cuda'])} on CUDA ({_b(ps['step_per_row']['cpu'])} on CPU) = "
              f"**{_b(ps['total']['cuda'])}** (CUDA), {_b(ps['total']['cpu'])} (CPU)"),
             (f"- KV cache: {_b(kv['full_per_token'])}/token for full layers + {_b(kv['rings'])} per slot for the "
              f"sliding rings (was {_b(kv['was_per_token'])}/token): {_b(kv['total'])} per slot at "
              f"{kv['context']:,} tokens (was {_b(kv['was'])})"),
             "- weights: " + ", ".join(f"{k} {_b(v['bytes'])}" for k, v in w.items()), "",
             f"**largest batch that fits** ({1 - sec['headroom']:.0%} of the memory usable):", "",
             "| memory | weights | usable | largest batch | peak at |", "|---|---|---|---|---|"]
    for f in sec["fits"]:
        lines.append(f"| {f['memory']} ({f['path']}) | {f['weights']} {_b(f['weights_bytes'])} | "
                     f"{_b(f['usable_bytes'])} | **{f['largest_batch']}** | {_PHASES[f['peak_phase']]} |")
    lines += ["", f"_{sec['assumptions']}_"]
    return "\n".join(lines) + "\n"
