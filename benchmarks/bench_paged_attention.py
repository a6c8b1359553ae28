"""Paged attention on a GPU: the Triton kernel (kernels/paged_attention.py) against its torch reference and
against scaled_dot_product_attention over the same keys stored contiguously (a dense kernel's time: what the
paging costs), at the real layers' shapes: sliding (16 query heads on 8 kv heads, d 256, window 1,024, a ring
of blocks) and full (16 on 2, d 512), each sequence a 256-row canvas attending its whole interval.

Work counted: FLOPs 4·rows·heads·keys·d (QKᵀ and PV, 2 per multiply-add); compulsory bytes: q and the output
once, each sequence's attended keys and values once per kv head. Prints a card, a table, then one JSON line.

    python benchmarks/bench_paged_attention.py [--batch 1 4] [--context 2048 8192] [--block-size 64] [--reps 20]

Needs CUDA (prints why and exits 0 elsewhere).
"""

from __future__ import annotations

import argparse
import json

import torch

LAYERS = {"sliding": (16, 8, 256, 1024), "full": (16, 2, 512, 0)}  # n_heads, n_kv, head_dim, window (0: none)
CANVAS = 256
HBM_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}  # data-sheet peaks (SXM)


def workload(layer: str, batch: int, context: int, block_size: int, dev, seed: int = 0):
    """batch sequences of `context` cached positions whose last CANVAS are the canvas; blocks shuffled in the
    pool. Returns (kernel args with tiles, dense (q, k, v, mask) per sequence, flops, bytes)."""
    from dgcli.kernels.paged_attention import row_tiles, rows_per_tile

    n_heads, n_kv, d, window = LAYERS[layer]
    g = torch.Generator(device=dev).manual_seed(seed)
    lo = max(0, context - CANVAS - window + 1) if window else 0  # the canvas sees the window before it
    ring = -(-(context - lo) // block_size) + 1 if window else 0
    per_seq = ring or -(-context // block_size)
    phys = torch.randperm(batch * per_seq, device=dev, generator=g).to(torch.int32)
    tables = phys.view(batch, per_seq)  # sequence s owns a random set of blocks
    k = torch.randn(batch, n_kv, context, d, device=dev, generator=g).bfloat16() * d**-0.25
    v = torch.randn(batch, n_kv, context, d, device=dev, generator=g).bfloat16()
    k_pool = torch.empty(n_kv, batch * per_seq * block_size, d, device=dev, dtype=torch.bfloat16)
    v_pool = torch.empty_like(k_pool)
    pos = torch.arange(lo, context, device=dev)
    blk = pos // block_size % ring if ring else pos // block_size
    for s in range(batch):
        slot = tables[s].long()[blk] * block_size + pos % block_size
        k_pool[:, slot], v_pool[:, slot] = k[s][:, pos], v[s][:, pos]
    n = batch * CANVAS
    q = torch.randn(n, n_heads, d, device=dev, generator=g).bfloat16() * d**-0.25
    row_seq = torch.arange(batch, device=dev, dtype=torch.int32).repeat_interleave(CANVAS)
    row_lo = torch.full((n,), lo, device=dev, dtype=torch.int32)
    row_hi = torch.full((n,), context, device=dev, dtype=torch.int32)
    t0, tn = row_tiles([CANVAS] * batch, rows_per_tile(n_heads, n_kv, d), dev)
    args = (q, k_pool, v_pool, row_seq, row_lo, row_hi, tables, block_size, ring)
    dense = (q.view(batch, CANVAS, n_heads, d).transpose(1, 2), k[:, :, lo:], v[:, :, lo:])  # [B, H|kv, C|L, d]
    keys = context - lo
    flops = 4 * n * n_heads * keys * d
    nbytes = 2 * n * n_heads * d * 2 + batch * n_kv * keys * d * 2 * 2
    return args, (t0, tn), dense, flops, nbytes


def timed(fn, reps: int) -> float:
    """Median milliseconds of `reps` calls, CUDA events, after two warm-up calls (compiles, autotuning)."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-reference", action="store_true", help="skip the torch reference (slow at long contexts)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_paged_attention: no CUDA device; the kernel is timed on a GPU only (exiting).")
        return
    import torch.nn.functional as F

    from dgcli.kernels.paged_attention import paged_attention, paged_attention_reference

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = next((gbs for key, gbs in HBM_GBS.items() if key in name), None)
    print(f"device: {name}; HBM peak {peak or 'unknown'} GB/s (data sheet); canvas {CANVAS} rows per sequence; "
          f"block size {args.block_size}; bf16; median of {args.reps}")
    print("| layer | batch | context | kernel ms | TFLOP/s | GB/s | % HBM | sdpa dense ms | reference ms | max err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    with torch.inference_mode():
        for layer in LAYERS:
            for batch in args.batch:
                for context in args.context:
                    kargs, (t0, tn), (dq, dk, dv), flops, nbytes = workload(layer, batch, context, args.block_size, dev)
                    run = lambda: paged_attention(*kargs, tile_row0=t0, tile_rows=tn)  # noqa: E731
                    sdpa = lambda: F.scaled_dot_product_attention(dq, dk, dv, scale=1.0, enable_gqa=True)  # noqa: E731
                    ms = timed(run, args.reps)
                    ms_dense = timed(sdpa, args.reps)
                    ref_ms = err = None
                    if not args.no_reference:
                        ref_ms = timed(lambda: paged_attention_reference(*kargs), max(3, args.reps // 4))
                        err = (run().float() - paged_attention_reference(*kargs).float()).abs().max().item()
                    gbs = nbytes / ms / 1e6
                    row = dict(layer=layer, batch=batch, context=context, ms=ms, tflops=flops / ms / 1e9, gbs=gbs,
                               hbm_share=gbs / peak if peak else None, sdpa_dense_ms=ms_dense, reference_ms=ref_ms,
                               max_abs_err=err)
                    rows.append(row)
                    fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
                    print(f"| {layer} | {batch} | {context} | {ms:.3f} | {row['tflops']:.1f} | {gbs:.0f} | "
                          f"{fmt(row['hbm_share'] and 100 * row['hbm_share'], '.1f')} | {ms_dense:.3f} | "
                          f"{fmt(ref_ms, '.3f')} | {fmt(err, '.2e')} |")
                    del kargs, dq, dk, dv
                    torch.cuda.empty_cache()
    print(json.dumps(dict(bench="paged_attention", device=name, block_size=args.block_size, rows=rows)))


if __name__ == "__main__":
    main()
