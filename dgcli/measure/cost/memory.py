"""Memory of a batched run: what a slot (request) of the engine costs, what is fixed, the largest batch that fits.

The peak of b slots = weights + b x KV (one paged cache) + b x loop state + the larger of a step (`step_bytes`: a
pass of the b canvases beside their commits, then the vocabulary pass, vocab.py) and a prefill (`prefill_bytes`);
on CUDA + one more step held by the CUDA graphs' pool (`peak_bytes`). Not counted: the CUDA context and allocator
fragmentation (the headroom), torch.compile's and the Triton autotuner's buffers, the CPU flash-attention
kernel's per-thread scratch, the prompts' ids. Notation: b requests, C canvas, N rows of a pass, H hidden, ab the
dtype's bytes (FP8 checkpoints keep bf16 activations and KV). Must not: run the model, allocate tensors, or import
torch: the engine's constants are restated here and tests/measure/test_memory.py keeps them equal and measures
every term.
"""

from __future__ import annotations

from dgcli.measure.cost.counts import DTYPE_BYTES, kv_row, param_counts, quantized_counts
from dgcli.measure.cost.vocab import vocab_bytes
from dgcli.model.config import ModelConfig

GIB = 2**30
HEADROOM = 0.10  # of the budget: CUDA context (~0.5 GiB) and the caching allocator's fragmentation
# (name, bytes): nominal memory (NVIDIA's "80 GB", "141 GB" are ~GiB: nvidia-smi shows 81,559 and 143,771 MiB)
GPUS = (("H100 80 GB", 80 * GIB), ("H200 141 GB", 141 * GIB))
FORMATS = ("bf16", "fp8", "nvfp4")
ACT_BYTES = {"bf16": 2, "fp8": 2, "nvfp4": 2, "fp32": 4}  # activations and KV of a run with these weights
KV_BLOCK = 16  # engine/block_manager.py's block_size default (it imports torch)
MOE_BLOCK = 64  # kernels/moe.py::BLOCK: experts_triton's fixed block_m (each expert's rows padded to it)
BUDGET = 2048  # engine/llm_engine.py: DEFAULT_BUDGET, rows per pass (running canvases first, then prompt chunks)
SERVE_SLOTS = 8  # cli/serve.py: --max-batch-size's default


def size(n: float) -> str:
    """Bytes in binary units, 4 significant digits: 47.03 GiB (every printer of bytes uses it)."""
    for unit, scale in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def moe_block_rows(pairs: int, experts: int, ab: int) -> int:
    """experts_triton's BLOCK_M on CUDA: kernels/moe.py::block_rows for bf16 activations, else MOE_BLOCK."""
    return 2 * MOE_BLOCK if ab == 2 and pairs > MOE_BLOCK * experts else MOE_BLOCK


def cache_positions(cfg: ModelConfig, context: int) -> tuple[int, int]:
    """Positions a slot holds per full and per sliding layer, in whole blocks, for requests of `context` positions:
    full layers those and a canvas (a canvas writes K/V where its block will commit), sliding layers a ring of the
    last W-1 (a pass reads its own keys from the pass)."""
    c, windows = cfg.canvas_length, [g.window for g in cfg.layers if g.window is not None]
    held, ring = context + c, min(max(windows) - 1, context + c) if windows else 0
    return -(-held // KV_BLOCK) * KV_BLOCK, -(-ring // KV_BLOCK) * KV_BLOCK


def kv_bytes(cfg: ModelConfig, context: int, ab: int = 2) -> dict:
    """One slot's KV cache for requests of `context` positions (engine/block_manager.py's layout): `full_per_token`
    on full layers, which hold `full_positions`; `rings` (fixed per slot) on sliding layers; `was_per_token` and
    `was`: every position on every layer; `windows`: a slot's sliding layers with prefix caching (`cache_blocks`)."""
    full, ring = cache_positions(cfg, context)
    row = [kv_row(g, ab) for g in cfg.layers]
    per = sum(r for r, g in zip(row, cfg.layers) if g.window is None)
    sliding = sum(r for r, g in zip(row, cfg.layers) if g.window is not None)
    windows = min(ring + 3 * KV_BLOCK, full) * sliding if ring else 0
    return {"context": context, "full_positions": full, "full_per_token": per, "rings": ring * sliding,
            "total": per * full + ring * sliding, "was_per_token": sum(row), "was": sum(row) * full,
            "sliding_per_token": sliding, "windows": windows}


def cache_blocks(cfg: ModelConfig, b: int, context: int, prefix_caching: bool = False) -> tuple[int, int]:
    """(full, sliding) pools' blocks for b slots: engine/block_manager.py's `pool_blocks`, restated. With prefix
    caching the sliding pool holds every slot's window and 3 blocks and one pass's causal rows (max(BUDGET,
    (b + 1) C): the commits and the prompt chunks), at most every position."""
    full, ring = (n // KV_BLOCK for n in cache_positions(cfg, context))
    if not ring or not prefix_caching:
        return b * full, b * ring
    rows = -(-max(BUDGET, (b + 1) * cfg.canvas_length) // KV_BLOCK)
    return b * full, min(b * full, b * (ring + 3) + rows)


def cache_bytes(cfg: ModelConfig, b: int, context: int, ab: int = 2, prefix_caching: bool = False) -> int:
    """The engine's whole KV cache for b slots (`cache_blocks`' pools)."""
    kv = kv_bytes(cfg, context, ab)
    full, sliding = cache_blocks(cfg, b, context, prefix_caching)
    return KV_BLOCK * (full * kv["full_per_token"] + sliding * kv["sliding_per_token"])


def weights_bytes(cfg: ModelConfig, fmt: str = "bf16") -> dict:
    """Weights in `fmt` (layer scalars fp32), as dgemma holds `dgemma quantize --fp8` / `--nvfp4`'s checkpoint: the
    `quantized_counts` matrices at 1 byte + a bf16 scale per output channel (fp8), or at 4 bits + an e4m3 scale per
    16 + an fp32 global per output channel (nvfp4, model/nvfp4.py); the rest bf16."""
    if fmt not in ACT_BYTES:
        raise ValueError(f"weight format {fmt!r}: use one of {tuple(ACT_BYTES)}")
    n, ab = param_counts(cfg), ACT_BYTES[fmt]  # fp32: a float32 run (random checkpoints, the bundled model)
    q, rows = quantized_counts(cfg) if fmt in ("fp8", "nvfp4") else (0, 0)
    rest = n["total"] - n["layer_scalars"] - q
    held = q + ab * rows if fmt == "fp8" else q // 2 + q // 16 + 4 * rows
    return {"format": fmt, "bytes": held + ab * rest + 4 * n["layer_scalars"], "fp8_parameters": q * (fmt == "fp8"),
            "nvfp4_parameters": q * (fmt == "nvfp4"), "bf16_parameters": rest if ab == 2 else 0}


def loop_state_bytes(cfg: ModelConfig, ab: int = 2, stability: int = 1, lag: int = 1) -> dict:
    """Per row, what the engine holds at a step's vocabulary pass outside the pass's temporaries; `lag` 1 (CUDA)
    also holds the previous, unsettled pass."""
    c, h = cfg.canvas_length, cfg.hidden_size
    parts = {
        "soft": 2 * c * h * ab,  # Request.soft [C, H] (a view of the last pass's out.soft) and their stack
        "canvas": 3 * 8 * c,  # Request.canvas (a view of next_canvas), canvas_in (their stack), the pass's ids
        "history": 2 * 8 * stability * c,  # Request.history (a view of the pushed [S, b, C]) and _sample's stack
        # uniform f64, noise int64 [b, C]; temp [b]; RowRules' three [b] (when settings differ)
        "draws": c * (8 + 8) + 4 + 16,
        # the unsettled pass: out.sample, out.argmax int64, out.entropy fp32, accepted bool, canvas_in; stop
        "last_pass": lag * (c * (8 + 8 + 4 + 1 + 8) + 1),
    }
    parts["total"] = sum(parts.values())
    return parts


def _norm(t: int, width: int, ab: int, cpu: bool) -> int:
    """An RMSNorm's peak over [t, width], its output included: torch's CPU rms_norm holds two fp32 copies (fp32
    input: y·r and its product with the weight) or three (bf16: the input's fp32 copy too); the Triton kernel
    (CUDA) only its output."""
    return (8 if ab == 4 else 12) * t * width if cpu else ab * t * width


def pass_bytes(cfg: ModelConfig, causal: list[tuple[int, int, int]], canvases: int, ab: int = 2, cpu: bool = False,
               soft: bool = True) -> int:
    """One pass's peak (`DiffusionGemma.forward_pass`; its inputs ids, soft aside): causal segments (prompt chunks,
    commits) as (rows, end position, how many), then `canvases` canvases of C rows; N rows. Held through the pass: the
    embedded rows (`parts`), RoPE cos/sin [N, d] per layer kind, the layout's positions and slots [N] int64 per
    cache group, per window the causal segments' bool masks [rows, keys] (CPU) or the kernel's int32 row bounds
    (CUDA); per layer the previous layer's q, k, v until reassigned. Attention reads the pool through views
    (a sequence whose blocks are not one run is gathered into a copy: not counted)."""
    c, h, n, k, e = cfg.canvas_length, cfg.hidden_size, cfg.num_attention_heads, cfg.top_k_experts, cfg.num_experts
    im, i_d, nc, tc = cfg.moe_intermediate_size, cfg.intermediate_size, sum(r * m for r, _, m in causal), canvases * c
    rows, xt = nc + tc, tc * h * ab  # xt: the canvas rows' [C·b, H]
    x, nh = rows * h * ab, _norm(rows, h, ab, cpu)  # the residual [N, H] and every [N, H] activation
    # Prologue: embed(ids) and its scaled copy; the canvases then run condition's MLP over the soft embedding
    # (pre_norm(soft), gelu(gate), up and their product [T, sc], down, the sum, post_norm); torch.cat of parts.
    sc, nt = 3 * tc * cfg.self_conditioning_size * ab, _norm(tc, h, ab, cpu)
    canvas = max(2 * xt, xt + nt, 2 * xt + sc if soft else 0, 3 * xt if soft else 0, 2 * xt + nt if soft else 0)
    peak = max(2 * nc * h * ab, nc * h * ab + canvas, 2 * x if nc and tc else 0)
    held = x + 8 * rows  # parts; the layout's positions
    for d in {g.kind: g.head_dim for g in cfg.layers}.values():  # rope_tables: freqs, emb, cos, sin fp32, cast
        peak = max(peak, held + x + 4 * rows + (10 + ab if ab < 4 else 14) * rows * d)
        held += 2 * rows * d * ab
    groups, windows, carry = set(), set(), 0  # what the layout built so far; the previous layer's q, k, v
    last = len(cfg.layers) - 1
    for i, g in enumerate(cfg.layers):
        qd, kvd = n * g.head_dim, g.num_kv_heads * g.head_dim
        q, kv = rows * qd * ab, rows * kvd * ab
        raw = kv * (2 if g.has_v_proj else 1)  # k_proj (and v_proj) outputs; K = V layers share k_raw
        ln = held + x + carry + x  # x, the previous layer's tensors, input_layernorm(x)
        # project: q_proj -> q_norm -> apply_rope (5 live: input, rotated, x·cos, rotated·sin, sum), then
        # k the same with k_raw (and v_raw) kept, then v_norm.
        peak = max(peak, held + x + carry + nh, ln + max(q + _norm(rows, qd, ab, cpu), 5 * q),
                   ln + q + raw + max(_norm(rows, kvd, ab, cpu), 5 * kv), ln + q + kv + raw + _norm(rows, kvd, ab, cpu))
        qkv = q + 2 * kv
        ring = g.window is not None
        if ring not in groups:  # PassLayout.slots(group): every row's slot (full), the causal rows' and rows (ring)
            held += 8 * rows if not ring else 16 * sum(r * m for r, _, m in causal)
        groups.add(ring)
        att = 0  # attend: out (q's size) and, per segment, what one call holds next to the masks built so far
        if g.window not in windows:
            windows.add(g.window)
            if cpu:  # masks, built as the segments are reached: [rows, keys] bool (a sliding one from 3)
                for r, end, m in causal:
                    keys = end if g.window is None else min(end, r + g.window - 1)
                    att = max(att, r * keys * (3 if g.window else 1))
                    held += m * r * keys
            else:  # kernel_meta: row_seq, lo, hi int32 [N], the row tiles' starts and lengths (<= N each)
                held += 20 * rows
        if ring:  # the causal rows' k, v picked for the ring's write (index_select), between the two kinds
            att = max(att, 2 * sum(r * m for r, _, m in causal) * kvd * ab)
        if cpu:  # torch SDPA per segment: its output (then written into `out`), fp32 log-sum-exp, a float mask;
            # on a sliding layer the segment's keys and values concatenated (the ring's then its own: < W + rows)
            prefix = max((end for _, end, _ in causal), default=0)  # the canvases sit after the causal rows
            for r, end, _ in causal + [(c, 0, canvases)]:
                keys = 0 if not end else end if not ring else min(end, r + g.window - 1)
                cat = 2 * (min(end or prefix, r + g.window - 1) if end else min(prefix, g.window - 1) + r) * kvd * ab \
                    if ring else 0
                att = max(att, r * qd * ab + 4 * n * r + r * keys * ab + cat)
        # then attn.out: o_proj [N, H] next to `out`, post_attention_layernorm, x + ...
        peak = max(peak, held + x + qkv + q + max(att, x), held + x + qkv + x + nh, held + 3 * x + qkv)
        carry = qkv
        if i == last and not canvases:
            return peak
        t = tc if i == last else rows  # the last layer's feed-forward: canvas rows only
        xf, nf, tk = t * h * ab, _norm(t, h, ab, cpu), t * k
        base = held + x + qkv  # the residual (a view of it in the last layer), q, k, v
        # Feed-forward: dense MLP (pre-norm, then gelu(gate), up and their product, down; post-norm), router
        # (norm, ·scale, ·root; logits and fp32 softmax [T, E]), then experts next to the dense output.
        peak = max(peak, base + nf, base + xf + 3 * t * i_d * ab, base + 2 * xf + t * i_d * ab, base + xf + nf,
                   base + 3 * xf, base + 2 * xf + t * e * (ab + 4))
        xn = base + xf + tk * (4 + 8)  # + dense out, routing w fp32 / idx int64 [T, k]
        if cpu:  # moe_cpu.experts_segments: experts, fp32 weights, order [T·k] held (20 B a pair); the gathered
            # rows and gate_up [T·k, 2Im] (kept to the end); act; y [T·k, H] weighted in place (bf16: an fp32 copy
            # and an fp32 result); _sum_slots' inverse, arange, out and tmp [T, H]
            gu, y = 2 * tk * im * ab, tk * h * ab  # ... and act: gu's half
            moe = 20 * tk + max(8 * tk + y + gu, 2 * gu, 3 * gu // 2 + y + (4 * tk + 8 * tk * h if ab < 4 else 0),
                                3 * gu // 2 + y + 16 * tk + 2 * xf)
        else:  # moe.experts_triton: act [slots, Im] (experts padded to BLOCK_M), y [T·k, H], out [T, H]
            bm = moe_block_rows(tk, e, ab)
            slots = -(-(tk + e * (bm - 1)) // bm) * bm
            moe = slots * (im * ab + 4) + tk * h * ab + xf + tk * (8 + 8 + 4)
        # pre_feedforward_layernorm_2, the experts over its output, then the post-norms and the sums (dense,
        # moe and the normed sum bound until the residual add)
        peak = max(peak, xn + nf, xn + xf + moe, xn + xf + nf, xn + 2 * xf + nf, xn + 3 * xf)
    return max(peak, held + tc * h * ab + carry + nt)  # epilogue: the final norm over the canvas rows


def step_bytes(cfg: ModelConfig, b: int, context: int, ab: int = 2, cpu: bool = False) -> dict:
    """A step's temporaries for b running requests, the larger of: the pass of their canvases, each beside the commit
    of its block that ended (2·b·C rows, the last commit ending at `context`; the commits' ids), and the vocabulary
    pass next to its input hidden [b, C, H]."""
    dec = pass_bytes(cfg, [(cfg.canvas_length, context, b)], b, ab, cpu) + 16 * b * cfg.canvas_length
    voc = b * cfg.canvas_length * cfg.hidden_size * ab + vocab_bytes(cfg, b, ab, cpu)
    return {"decode": dec, "vocab_pass": voc, "total": max(dec, voc)}


def prefill_bytes(cfg: ModelConfig, b: int, prompt_len: int, ab: int = 2, cpu: bool = False) -> int:
    """The first prefill pass of b requests admitted at once: prompt chunks of at most `prompt_len` ids under the
    BUDGET rows, each masked against `prompt_len` keys, the canvases of the prompts completing in it (at most one
    more than its chunks: a pass also ends the previous one's tails), the pass's ids."""
    c, chunk = cfg.canvas_length, min(prompt_len, BUDGET)
    whole = min(b, BUDGET // chunk)  # whole chunks, then what is left of the budget
    causal = [(chunk, prompt_len, whole)]
    causal += [(BUDGET - whole * chunk, prompt_len, 1)] if whole < b and BUDGET % chunk else []
    rows = sum(r * m for r, _, m in causal)
    done = b if rows == b * prompt_len else min(b, whole + len(causal))
    return pass_bytes(cfg, causal, done, ab, cpu, soft=False) + 8 * (rows + done * c)


def peak_bytes(cfg: ModelConfig, b: int, *, context: int, prompt_len: int = 256, fmt: str = "bf16",
               ab: int = 2, cpu: bool = False, stability: int = 1, prefix_caching: bool = False) -> dict:
    """The most memory b slots hold at once (module docstring), by part; prefix_caching: its KV (`cache_bytes`)."""
    weights = weights_bytes(cfg, fmt)["bytes"]
    kv = cache_bytes(cfg, b, context, ab, prefix_caching)
    state = b * loop_state_bytes(cfg, ab, stability, lag=0 if cpu else 1)["total"]
    phases = {"step": step_bytes(cfg, b, context, ab, cpu)["total"],
              "prefill": prefill_bytes(cfg, b, prompt_len, ab, cpu)}
    top = max(phases, key=phases.get)
    # CUDA graphs (on by default on CUDA: model/graphs.py) keep a captured step's temporaries in their own pool,
    # beside the eager passes' (commits, prompts), and their static ids, inputs and outputs (buckets 1..b: < 2b)
    graphs = 0 if cpu else phases["step"] + 2 * b * cfg.canvas_length * (8 + 2 * cfg.hidden_size * ab)
    return {"weights": weights, "kv_cache": kv, "loop_state": state, "phases": phases, "peak_phase": top,
            "graphs": graphs, "total": weights + kv + state + phases[top] + graphs}


def one_request(cfg: ModelConfig, context: int, prompt_len: int = 256, ab: int = 2) -> dict[str, int]:
    """By path (cuda, cpu), what one request holds beyond its weights and KV at its peak (`peak_bytes` of one slot)."""
    out = {}
    for path in ("cuda", "cpu"):
        p = peak_bytes(cfg, 1, context=context, prompt_len=prompt_len, ab=ab, cpu=path == "cpu")
        out[path] = p["total"] - p["weights"] - p["kv_cache"]
    return out


def largest_batch(cfg: ModelConfig, budget: int, *, headroom: float = HEADROOM, limit: int = 1 << 20, **kw) -> int:
    """The largest b whose `peak_bytes` fits budget·(1 - headroom), 0 for none (a bisection: it grows with b)."""
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
    """A step's temporaries per extra row in large batches (the slope from 64 to 128 rows: fixed chunks drop out)."""
    return (step_bytes(cfg, 128, context, ab, cpu)["total"] - step_bytes(cfg, 64, context, ab, cpu)["total"]) / 64


def batch_memory(cfg: ModelConfig, *, context: int, prompt_len: int, dtype: str, budgets: list[dict],
                 headroom: float = HEADROOM, stability: int = 1) -> dict:
    """The card's batch-memory section: per-slot bytes at `context` cached tokens in `dtype`, and per budget
    ({"name", "bytes", "cpu"}) and weight format the largest batch that fits."""
    ab = DTYPE_BYTES[dtype]
    kv = kv_bytes(cfg, context, ab)
    state = loop_state_bytes(cfg, ab, stability)  # CUDA's (lag 1); the CPU's holds no unsettled pass
    step = {"cuda": step_per_row(cfg, context, ab), "cpu": step_per_row(cfg, context, ab, cpu=True)}
    row = {"cuda": state["total"], "cpu": state["total"] - state["last_pass"]}
    fits = []
    formats = FORMATS + (("fp32",) if dtype == "float32" else ())
    for bud in budgets:
        usable = int(bud["bytes"] * (1 - headroom))
        for fmt in formats:
            kw = {"context": context, "prompt_len": prompt_len, "fmt": fmt, "ab": ACT_BYTES[fmt], "cpu": bud["cpu"],
                  "stability": stability}
            most, most_pc = (largest_batch(cfg, bud["bytes"], headroom=headroom, prefix_caching=p, **kw) for p in (0, 1))
            w = weights_bytes(cfg, fmt)["bytes"]
            fits.append({"memory": bud["name"], "memory_bytes": bud["bytes"], "path": "cpu" if bud["cpu"] else "cuda",
                         "weights": fmt, "weights_bytes": w, "usable_bytes": usable, "largest_batch": most,
                         "largest_batch_prefix_caching": most_pc,
                         "peak_phase": peak_bytes(cfg, most, **kw)["peak_phase"] if most else
                         "weights" if w > usable else "one_slot"})
    return {
        "context": context, "dtype": dtype, "headroom": headroom,
        "prefix_cache_blocks": dict(zip(("full", "sliding"), cache_blocks(cfg, SERVE_SLOTS, context, True))),
        "per_slot": {"kv_cache": kv["total"], "kv": kv, "loop_state": state["total"], "loop_state_parts": state,
                     "step_per_row": step, "total": {p: kv["total"] + row[p] + s for p, s in step.items()}},
        "weights": {fmt: weights_bytes(cfg, fmt) for fmt in formats},
        "fits": fits,
        "assumptions": (
            f"peak = weights + b x (paged KV: full layers the context and a canvas, sliding layers a ring of window-1 "
            f"and one pass's positions, in blocks of {KV_BLOCK}; + sampler state) + the larger of a step's temporaries "
            f"(b canvases beside their commits, then the vocabulary pass) and a prefill pass's ({prompt_len}-token "
            f"prompts in chunks under the {BUDGET}-row pass budget), on CUDA + one more step's and the static buffers "
            f"of the CUDA graphs (the default there); usable = memory less {headroom:.0%} headroom "
            f"(CUDA context, allocator fragmentation); bf16 activations and KV (fp32 for fp32); FP8 = attention, MLP, "
            f"expert matrices at 1 byte/param + a bf16 scale per output channel, embedding/LM head, router, "
            f"self-conditioning MLP and norms bf16 (as dgemma holds an FP8-dynamic checkpoint: `dgemma quantize --fp8`); "
            f"NVFP4 = the same matrices at 4 bits + an e4m3 scale per 16 + an fp32 global per output channel "
            f"(`dgemma quantize --nvfp4`)."),
    }


_PHASES = {"step": "a step", "prefill": "the prefill", "weights": "weights alone exceed it",
           "one_slot": "one slot does not fit"}


def markdown(sec: dict) -> str:
    """The section as `dgemma info` prints it."""
    ps, w, pc = sec["per_slot"], sec["weights"], sec["prefix_cache_blocks"]
    st, kv = ps["loop_state_parts"], ps["kv"]
    lines = [(f"**batch memory** ({sec['dtype']} KV, {sec['context']:,} cached tokens per slot = the longest "
              f"request's prompt + every block but the last; --context):"),
             (f"- per slot: KV cache {size(ps['kv_cache'])} + sampler state {size(ps['loop_state'])} (soft embeddings "
              f"{size(st['soft'])}, canvas, history, the unsettled pass's outputs) + step temporaries "
              f"{size(ps['step_per_row']['cuda'])} on CUDA ({size(ps['step_per_row']['cpu'])} on CPU) = "
              f"**{size(ps['total']['cuda'])}** (CUDA), {size(ps['total']['cpu'])} (CPU)"),
             (f"- KV cache: {size(kv['full_per_token'])}/token for full layers ({kv['full_positions']:,} positions: "
              f"the context and a canvas) + {size(kv['rings'])} per slot for the sliding rings: "
              f"{size(kv['total'])} per slot at {kv['context']:,} tokens (without rings, every layer at "
              f"{size(kv['was_per_token'])}/token: {size(kv['was'])}); with prefix caching (the default) the sliding "
              f"layers hold {size(kv['windows'])} per slot (its window and 3 blocks) and one pass's rows beside them"),
             (f"- prefix cache (`serve`'s {SERVE_SLOTS} slots): {pc['full']:,} blocks of {KV_BLOCK} positions on full "
              f"layers, {pc['sliding']:,} on sliding layers; blocks no request holds stay cached until one needs room"),
             "- weights: " + ", ".join(f"{k} {size(v['bytes'])}" for k, v in w.items()), "",
             f"**largest batch that fits** ({1 - sec['headroom']:.0%} of the memory usable):", "",
             "| memory | weights | usable | largest batch | peak at | with prefix caching |", "|---|---|---|---|---|---|"]
    for f in sec["fits"]:
        lines.append(f"| {f['memory']} ({f['path']}) | {f['weights']} {size(f['weights_bytes'])} | "
                     f"{size(f['usable_bytes'])} | **{f['largest_batch']}** | {_PHASES[f['peak_phase']]} | "
                     f"{f['largest_batch_prefix_caching']} |")
    lines += ["", f"_{sec['assumptions']}_"]
    return "\n".join(lines) + "\n"
