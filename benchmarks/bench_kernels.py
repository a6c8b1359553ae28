"""Per-kernel benchmark: time, achieved bytes/s and FLOP/s of each fused op against the device's peaks,
for the implementation `kernels.dispatch` picks (Triton on CUDA, the fast torch paths on CPU) and for
the torch reference, at the real 26B-A4B shapes on a GPU (small shapes with --small).

Prints a card (device, peaks and where they come from), a table, then one JSON line last.
Work counted: useful FLOPs (2 per multiply-add; the vocab pass: the head GEMM and the soft-embedding GEMM,
each once, as the Triton pass now runs them; the draw's per-row group recomputation is not counted) and
compulsory bytes (every input read once, every output written once; FP8 weights at 1 byte) — so
achieved/peak is a lower bound on how busy the device was. fp8_linear: weight-only FP8 (the W8A16 kernel on
CUDA) against its reference, which dequantizes the whole weight on every call.

    python benchmarks/bench_kernels.py [--small] [--reps 20] [--peak-tflops X --peak-gbs Y]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

# Dense bf16 tensor-core TFLOP/s and HBM GB/s from the vendors' data sheets (SXM parts).
GPU_PEAKS = {"H100": (989.0, 3350.0), "H200": (989.0, 4800.0), "A100": (312.0, 2039.0), "L4": (121.0, 300.0)}


def device_peaks(dev: torch.device, args) -> tuple[float | None, float | None, str]:
    if args.peak_tflops and args.peak_gbs:
        return args.peak_tflops * 1e12, args.peak_gbs * 1e9, "given on the command line"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        for key, (tf, gbs) in GPU_PEAKS.items():
            if key in name:
                return tf * 1e12, gbs * 1e9, f"data sheet ({key})"
        return None, None, f"unknown GPU {name!r}: pass --peak-tflops and --peak-gbs"
    # CPU: measure both now (a large bf16 GEMM, a large copy).
    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    t = best(lambda: a @ b, dev, 5)
    x = torch.empty(64 * 2**20 // 4)
    y = torch.empty_like(x)
    tc = best(lambda: y.copy_(x), dev, 5)
    return 2 * 2048**3 / t, 2 * x.numel() * 4 / tc, "measured now (2048³ bf16 GEMM, 64 MiB copy)"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def best(fn, dev: torch.device, reps: int) -> float:
    fn()
    sync(dev)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]  # median


def cases(dev: torch.device, small: bool):
    """(name, make() -> (kernel fn, reference fn), flops, bytes) for each op at its benchmark shape."""
    from dgcli.kernels import dispatch, reference, reference_ops

    bf = torch.bfloat16
    n = 256  # the canvas
    h, v, inter, e, k, dense = (1024, 32768, 512, 16, 4, 1536) if small else (2816, 262144, 704, 128, 8, 2112)
    g = torch.Generator(device=dev).manual_seed(0)

    def vocab():
        hidden = torch.randn(1, n, h, device=dev, generator=g).to(bf)
        embed = (torch.randn(v, h, device=dev, generator=g) * 0.02).to(bf)
        kw = dict(softcap=30.0, temperature=torch.tensor(0.6, device=dev), embed_scale=torch.tensor(53.0).to(bf),
                  uniform=torch.rand(1, n, device=dev, generator=g, dtype=torch.float64))
        return (lambda: dispatch.vocab_pass(hidden, embed, **kw), lambda: reference.vocab_pass(hidden, embed, **kw))

    def experts():
        x = torch.randn(n, h, device=dev, generator=g).to(bf)
        w, idx = torch.softmax(torch.randn(n, e, device=dev, generator=g), -1).topk(k, -1)
        gu = (torch.randn(e, 2 * inter, h, device=dev, generator=g) * h**-0.5).to(bf)
        dn = (torch.randn(e, h, inter, device=dev, generator=g) * inter**-0.5).to(bf)
        return (lambda: dispatch.experts(x, w, idx, gu, dn),
                lambda: reference_ops.experts_reference(x, w, idx, gu, dn))

    def fp8_linear():
        from dgcli.kernels import fp8

        x = torch.randn(n, h, device=dev, generator=g).to(bf)
        w = torch.randn(dense * 2, h, device=dev, generator=g) * h**-0.5  # [N, K]: a q projection's shape
        s = (w.abs().amax(-1, keepdim=True) / fp8.FP8_MAX).to(bf)
        q = (w / s.float()).to(fp8.FP8)
        return (lambda: dispatch.fp8_linear(x, q, s), lambda: fp8.linear_weight_only(x, q, s, tile_bytes=None))

    def norm():
        x = torch.randn(n, h, device=dev, generator=g).to(bf)
        wt = torch.rand(h, device=dev, generator=g).to(bf)
        return (lambda: dispatch.rms_norm(x, wt, 1e-6), lambda: reference_ops.rms_norm_reference(x, wt, 1e-6))

    return [
        ("vocab_pass", vocab, 4 * n * v * h, v * h * 2 + n * h * 2 * 2 + n * 20, dispatch.implementation("vocab_pass", dev)),
        ("experts", experts, 6 * n * k * h * inter, e * 3 * h * inter * 2 + n * h * 2 * 2 + n * k * 12,
         dispatch.implementation("experts", dev)),
        ("rms_norm", norm, 4 * n * h, n * h * 2 * 2 + h * 2, dispatch.implementation("rms_norm", dev)),
        ("fp8_linear", fp8_linear, 2 * n * 2 * dense * h, 2 * dense * h + 2 * dense * 2 + n * (h + 2 * dense) * 2,
         dispatch.implementation("fp8_linear", dev)),
    ], dict(n=n, h=h, v=v, inter=inter, experts=e, top_k=k, dense=dense)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small shapes (default on CPU)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--peak-gbs", type=float, default=None)
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    small = args.small or dev.type == "cpu"
    pf, pb, source = device_peaks(dev, args)
    table, shapes = cases(dev, small)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"device: {name}; peaks: "
          + (f"{pf / 1e12:.1f} TFLOP/s bf16, {pb / 1e9:.0f} GB/s" if pf else "unknown") + f" ({source})")
    print(f"shapes: {shapes}; reps {args.reps} (median)")
    print("| op | impl | time ms | GFLOP/s | % peak FLOP/s | GB/s | % peak BW | reference ms |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    with torch.inference_mode():
        for op, make, flops, nbytes, impl in table:
            fast, ref = make()
            t = best(fast, dev, args.reps)
            tr = None if args.no_reference else best(ref, dev, max(3, args.reps // 4))
            row = dict(op=op, impl=impl, ms=t * 1e3, gflops=flops / t / 1e9, gbs=nbytes / t / 1e9,
                       flop_share=flops / t / pf if pf else None, bw_share=nbytes / t / pb if pb else None,
                       reference_ms=None if tr is None else tr * 1e3)
            rows.append(row)
            pct = lambda x: f"{100 * x:.1f}" if x is not None else "n/a"  # noqa: E731
            print(f"| {op} | {impl} | {row['ms']:.3f} | {row['gflops']:.0f} | {pct(row['flop_share'])} | "
                  f"{row['gbs']:.0f} | {pct(row['bw_share'])} | "
                  + (f"{row['reference_ms']:.3f}" if tr is not None else "-") + " |")
    print(json.dumps({"device": name, "peak_flops": pf, "peak_bytes_per_s": pb, "peak_source": source,
                      "shapes": shapes, "rows": rows}))


if __name__ == "__main__":
    main()
