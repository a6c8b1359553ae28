"""Each non-attention Triton kernel's time on an H100, computed (not measured) from the launch its wrapper makes at
the released config's shapes (grid, tiles: what benchmarks/kernel_targets.py compiles), against its floor, at batch
1 and 8, bf16 and weight-only FP8 weights. benchmarks/kernel_targets.py prints the table after its AOT table; on a GPU,
benchmarks/bench_kernels.py measures. Must not: launch anything or need a GPU.

    python benchmarks/kernel_floor.py [--dry-run]
"""

from __future__ import annotations

from harness import emit, parser
from kernel_targets import CANVAS, E, H, HEAD_DIMS, I, TOPK, V, _cdiv


def computed(batch: int, fp8: bool = False) -> list[tuple]:
    """(kernel, CTAs, floor s, computed s) of each non-attention kernel of a canvas pass at `batch`, released shapes,
    bf16 activations (`fp8`: weight-only FP8 experts and linears). Computed, not measured, on an H100 SXM (its
    dgcli.measure.peaks row, 132 SMs, each with 1/132 of both peaks): CTAs run in waves of 132, each at its SM's share
    for the FLOPs of its tiles and every byte it loads or stores (re-reads and padding: what the wrapper's grid and
    tiles make it do; no L2 reuse, latency or overlap); the floor: the useful FLOPs and least bytes at the peaks.
    Experts: uniform routing, the fixed 64-wide tile; the soft GEMM: its first tuned tile. Not modelled: dynamic FP8,
    NVFP4."""
    from dgcli.kernels.fp8_linear import CONFIGS
    from dgcli.kernels.moe import BLOCK as B, block_rows
    from dgcli.kernels.vocab_pass import SOFT_SPLITS, SOFT_TUNE, VOCAB_SPLITS
    from dgcli.measure.peaks import DEVICE_TABLE

    n, a, wb, mlp, qkv = CANVAS * batch, 2, 1 if fp8 else 2, 2112, 16 + 2 * 8  # rows, bytes, MLP width, sliding heads
    pairs = n * TOPK
    bm = block_rows(pairs, E)
    blocks, touched = E * _cdiv(pairs // E, bm), E * (1 - (1 - TOPK / E) ** n)  # row blocks; experts read
    m8, n8 = CONFIGS["bf16"][:2]
    split, (sm, sn), per_soft, stats = _cdiv(_cdiv(V, VOCAB_SPLITS), 64) * 64, SOFT_TUNE["bf16"][0][:2], \
        _cdiv(V, SOFT_SPLITS), 20 * VOCAB_SPLITS
    rows = [  # (kernel, CTAs, FLOPs a CTA, bytes a CTA, useful FLOPs, least bytes)
        ("fused._rms_norm_kernel (+res, +pre)", n, 0, 5 * H * a, 0, 4 * n * H * a + H * a),
        ("fused._qkv_norm_rope_kernel d=256", n * qkv, 0, 4 * 256 * a, 0, n * qkv * 256 * 2 * a),
        ("fused._gelu_mul_kernel", n * _cdiv(mlp, 1024), 0, 3 * 1024 * a, 0, 3 * n * mlp * a),
        ("fused._router_input_kernel", n, 0, 3 * H * a, 0, 2 * n * H * a + H * a),
        ("fused._route_kernel", n, 0, 2 * E * a + TOPK * 12, 0, n * (E * a + TOPK * 12) + E * a),
        ("moe._align_kernel", 1, 0, pairs * 16 + blocks * 4, 0, pairs * 16 + blocks * 4),
        ("moe._gate_up_kernel", blocks * _cdiv(I, B), 4 * bm * H * B, bm * H * a + 2 * B * H * wb + bm * B * a,
         4 * pairs * H * I, touched * 2 * I * H * wb + n * H * a + pairs * I * a),
        ("moe._down_kernel", blocks * _cdiv(H, B), 2 * bm * I * B, bm * I * a + B * I * wb + bm * B * a,
         2 * pairs * I * H, touched * H * I * wb + pairs * (I + H) * a),
        ("moe._combine_kernel", n * _cdiv(H, 1024), 0, (TOPK + 1) * 1024 * a, 0, n * (TOPK + 1) * H * a)]
    rows += [(f"fp8_linear._w8a16_kernel {name}", _cdiv(n, m8) * _cdiv(o, n8), 2 * m8 * n8 * k,
              m8 * k * a + n8 * k + m8 * n8 * a, 2 * n * o * k, o * k + n * (k + o) * a)
             for name, o, k in (("q", 4096, H), ("o", H, 4096), ("mlp gate_up", 2 * mlp, H), ("mlp down", H, mlp))
             if fp8]
    rows += [
        ("vocab_pass._stats_kernel", _cdiv(n, 64) * VOCAB_SPLITS, 2 * 64 * split * H,
         (64 + split) * H * a + 64 * split * a, 2 * n * V * H, (V + n) * H * a + n * V * a),
        ("vocab_pass._combine_kernel", _cdiv(n, 128), 0, 128 * (stats + 24), 0, n * (stats + 24)),
        ("vocab_pass._group_logits_kernel", n, 128 * H, 65 * H * a + 256, 128 * n * H, n * (65 * H * a + 256)),
        ("vocab_pass._probs_kernel", n * _cdiv(V, 1024), 0, 2 * 1024 * a, 0, 2 * n * V * a),
        ("vocab_pass._soft_kernel", _cdiv(n, sm) * _cdiv(H, sn) * SOFT_SPLITS, 2 * sm * sn * per_soft,
         (sm + sn) * per_soft * a + sm * sn * 4, 2 * n * V * H, (V * H + n * V) * a + n * H * 4)]
    pk = DEVICE_TABLE["H100"]
    return [(name, ctas, max(fl / pk.flops_per_s, by / pk.bytes_per_s),
             _cdiv(ctas, 132) * max(f * 132 / pk.flops_per_s, b * 132 / pk.bytes_per_s))
            for name, ctas, f, b, fl, by in rows]


def computed_table(batches=(1, 8)) -> str:
    out = ["Computed, not measured (H100 SXM: 989 TFLOP/s bf16, 3.35 TB/s, 132 SMs; `computed` says how): each "
           "kernel's time as launched against its floor.", "", "| kernel | weights | " + " | ".join(
               f"batch {b}: CTAs, floor us, computed us, x" for b in batches) + " |", "|---|---|" + "---|" * len(batches)]
    for fp8 in (False, True):  # FP8: only the rows that differ from bf16
        for i, (name, *_) in enumerate((per := [computed(b, fp8) for b in batches])[0]):
            if not fp8 or "moe._gate_up" in name or "moe._down" in name or "fp8" in name:
                out.append(f"| {name} | {'fp8-w' if fp8 else 'bf16'} | " + " | ".join(
                    f"{r[i][1]}, {r[i][2] * 1e6:.3g}, {r[i][3] * 1e6:.3g}, {r[i][3] / r[i][2]:.2f}" for r in per) + " |")
    return "\n".join(out)


def attention_times(sms: int = 132, flops: float = 989e12, bw: float = 3.35e12) -> str:
    """Computed, not measured: paged attention's time per layer call on an H100 SXM (peak bf16 rate and bandwidth,
    one program per SM), a 256-row canvas per sequence over a prompt, from the wrapper's `launches`, against the
    floor max(4·rows·heads·keys·d / rate, K+V+q+out bytes / bw). Ours: those bytes plus the pieces' fp32 scratch
    (written, read), (V_PARTS+1)/2 x the flops (each part recomputes the scores), at the rate x the last wave's fill."""
    import torch

    from dgcli.kernels.paged_attention import MIN_CHUNK, launches

    lines = ["| layer | prompt | batch | keys | programs | pieces | floor us | ours us (computed) | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, n_kv, d, window in (("sliding", 8, HEAD_DIMS[0], 1024), ("full", 2, HEAD_DIMS[1], None)):
        for prompt in (1000, 4000):
            for batch in (1, 8):
                keys = (prompt if window is None else min(prompt, window - 1)) + CANVAS
                (_, f, _), *_ = launches(d, 16 // n_kv, torch.bfloat16, keys)
                pieces = min(max(keys // MIN_CHUNK, 1), f["SPLITS"])
                rows = batch * CANVAS * 16  # (row, query head) pairs
                programs = batch * CANVAS // f["ROWS"] * n_kv * pieces * f["V_PARTS"]
                bytes_ = batch * keys * n_kv * d * 4 + rows * d * 4
                floor = max(4 * rows * keys * d / flops, bytes_ / bw)
                fill = programs / (sms * -(-programs // sms))
                scratch = rows * pieces * (d + 2) * 8 if pieces > 1 else 0
                ours = max(2 * rows * keys * d * (f["V_PARTS"] + 1) / (flops * fill), (bytes_ + scratch) / bw)
                lines.append(f"| {name} d={d} | {prompt} | {batch} | {keys} | {programs} | {pieces} | "
                             f"{floor * 1e6:.1f} | {ours * 1e6:.1f} | {ours / floor:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser(__doc__).parse_args()  # --dry-run: the same arithmetic (it takes milliseconds)
    print(computed_table())
    print("\npaged attention per layer call, H100 SXM, computed (not measured):\n" + attention_times())
    emit({"bench": "kernel_floor", "rows": [dict(batch=b, fp8=f, kernel=k, ctas=c, floor_us=fl * 1e6, computed_us=t * 1e6)
                                           for b in (1, 8) for f in (False, True) for k, c, fl, t in computed(b, f)]})


if __name__ == "__main__":
    main()
