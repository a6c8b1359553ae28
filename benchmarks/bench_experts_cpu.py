"""One layer's routed experts on CPU (kernels/moe_cpu.py) against the same run's bf16 GEMM rate: every path at the
released config's shapes (128 experts top-8, H 2816, I 704) with 256 and 2,048 rows, and at the 200 M benchmark
config's (12 experts top-4, H 1024, I 512, 256 rows), bf16, 1 and 2 threads. Prints a card, a table, each path's
rounds, then one JSON line.

GEMM rate: `F.linear` and the prepacked GEMM (kernels/linear_cpu.py) on 2,048 rows against one expert's gate_up
[2I, H] and down [H, I] weights (the same K and N as the experts' GEMMs; the weights stay in cache across
rounds), FLOP-weighted over the pair; per round, the faster of the two is the denominator of "% GEMM". The
GEMM pair, the weight stream and the paths run in turn round by round (this machine's speed drifts by tens of
%, and others share its 2 cores): times are medians, "% GEMM" is the median over rounds of the path's rate
over that round's GEMM rate. Weight stream: the prepacked GEMM pair on one row through every expert, i.e. one
read of all the expert weights at the machine's memory rate; "floor ms" is its time, which no path can beat
where every expert gets tokens (all of them do here). Each path's output is compared with `experts_reference`
(bits: "=" equal).

Paths: segments, grouped, packed (experts_packed: oneDNN, the reference's bits), packed's two ways forced: in_turn
(one expert at a time on all threads) and split (experts shared out across one-thread workers), and native
(experts_native with the C bf16 GEMM, kernels/gemm_bf16.py: what a bf16 session runs where that GEMM sums as oneDNN
does, "=" then; skipped where it is not available).

    python benchmarks/bench_experts_cpu.py [--threads 1 2] [--rounds 5] [--configs real 200m] [--paths ...] [--rows ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_step import cpu_name, load_avg, median  # noqa: E402

# name -> (experts, top-k, hidden, intermediate, row counts)
CONFIGS = {"real": (128, 8, 2816, 704, (256, 2048)), "200m": (12, 4, 1024, 512, (256,))}
GEMM_ROWS = 2048
PATHS = ["segments", "grouped", "packed", "in_turn", "split", "native"]


def timed(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each callable per round, all run once per round in turn (one warm-up round first)."""
    times = {name: [] for name in fns}
    for r in range(rounds + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t)
    return times


def run_config(name: str, threads: int, rounds: int, paths: list[str], only_rows: list[int]) -> list[dict]:
    from dgcli.kernels import moe_cpu
    from dgcli.kernels.linear_cpu import linear, pack
    from dgcli.kernels.reference_ops import experts_reference

    e, k, h, inter, row_counts = CONFIGS[name]
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5).bfloat16()  # [E, 2I, H]
    down = (torch.randn(e, h, inter, generator=g) * inter ** -0.5).bfloat16()  # [E, H, I]
    pg = [pack(gate_up[i]) for i in range(e)]
    pd = [pack(down[i]) for i in range(e)]
    packed = all(p is not None for p in pg + pd)
    try:  # the C bf16 GEMM (absent from older trees: the same script times both)
        from dgcli.kernels import gemm_bf16
        native = (gemm_bf16.pack(gate_up), gemm_bf16.pack(down)) if gemm_bf16.available() else None
    except ImportError:
        native = None
    # The GEMM rate's pair (2,048 rows against expert 0's weights) and the weight stream (one row through
    # every expert) run in the same rounds as the paths, so a slow round slows them all alike.
    a = torch.randn(GEMM_ROWS, h, generator=g).bfloat16()  # [2048, H]
    b = torch.randn(GEMM_ROWS, inter, generator=g).bfloat16()  # [2048, I]
    one, act = a[:1], b[:1]
    refs = {"gemm_f_linear": lambda: (F.linear(a, gate_up[0]), F.linear(b, down[0]))}
    if packed:
        refs["gemm_packed"] = lambda: (linear(a, pg[0]), linear(b, pd[0]))
        refs["stream"] = lambda: [(linear(one, u), linear(act, d)) for u, d in zip(pg, pd)]
    gemm_flops = 2 * GEMM_ROWS * 3 * h * inter
    rows = []
    for n in [n for n in row_counts if not only_rows or n in only_rows]:
        x = torch.randn(n, h, generator=g).bfloat16()
        w, idx = torch.randn(n, e, generator=g).softmax(-1).topk(k, -1)  # [N, k] fp32, [N, k]
        fns = {"segments": lambda: moe_cpu.experts_segments(x, w, idx, gate_up, down),
               "grouped": lambda: moe_cpu.experts_grouped(x, w, idx, gate_up, down)}
        if packed:  # the default choice, and each of its two ways forced (old vs new in the same rounds)
            fns["packed"] = lambda: moe_cpu.experts_packed(x, w, idx, pg, pd, inter)
            fns["in_turn"] = lambda: moe_cpu.experts_packed(x, w, idx, pg, pd, inter, split=False)
            fns["split"] = lambda: moe_cpu.experts_packed(x, w, idx, pg, pd, inter, split=True)
        if native is not None:
            fns["native"] = lambda: moe_cpu.experts_native(x, w, idx, *native, inter, gemm_bf16)
        fns = {p: fn for p, fn in fns.items() if not paths or p in paths}
        want = experts_reference(x, w, idx, gate_up, down)
        exact = {p: torch.equal(fn(), want) for p, fn in fns.items()}
        times = timed({**refs, **fns}, rounds)
        # per round: the faster of the two GEMMs is the denominator
        gemm = [min(ts) for ts in zip(times["gemm_f_linear"], times.get("gemm_packed", times["gemm_f_linear"]))]
        rate = {r: gemm_flops / median(times[r]) / 1e9 for r in refs if r.startswith("gemm")}
        floor = median(times["stream"]) if packed else None
        flops = 2 * n * k * 3 * h * inter
        for path in fns:
            t = median(times[path])
            rows.append({"config": name, "rows": n, "threads": threads, "path": path, "ms": t * 1e3,
                         "gflops": flops / t / 1e9,
                         "pct_gemm": 100 * median([gt / gemm_flops * flops / pt for gt, pt in zip(gemm, times[path])]),
                         "ms_rounds": [pt * 1e3 for pt in times[path]],
                         "pct_rounds": [100 * gt / gemm_flops * flops / pt for gt, pt in zip(gemm, times[path])],
                         "gemm_gflops": rate, "bits_equal_reference": exact[path],
                         "floor_ms": floor and floor * 1e3,
                         "weights_gbs": floor and (gate_up.numel() + down.numel()) * 2 / floor / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--paths", nargs="+", default=[], choices=PATHS, help="only these paths (default: all)")
    ap.add_argument("--rows", type=int, nargs="+", default=[], help="only these row counts (default: all)")
    args = ap.parse_args()
    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    print(f"cpu: {cpu_name()} | AMX: {'yes' if amx else 'no'} | torch {torch.__version__} | load {load_avg()}")
    for c in args.configs:
        e, k, h, inter, ns = CONFIGS[c]
        print(f"{c}: {e} experts top-{k}, H {h}, I {inter}, rows {ns}: "
              f"{e * 3 * h * inter * 2 / 2**20:.0f} MiB of bf16 expert weights")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for c in args.configs:
            rows += run_config(c, threads, args.rounds, args.paths, args.rows)
    print(f"\n{'config':6} {'rows':>5} {'thr':>3} {'path':9} {'ms':>8} {'GFLOP/s':>8} {'% GEMM':>7} "
          f"{'GEMM (F.linear/packed)':>23} {'floor ms':>9} {'GB/s':>5} bits")
    for r in rows:
        gr = "/".join(f"{v:.0f}" for v in r["gemm_gflops"].values())
        print(f"{r['config']:6} {r['rows']:5} {r['threads']:3} {r['path']:9} {r['ms']:8.1f} {r['gflops']:8.0f} "
              f"{r['pct_gemm']:6.1f}% {gr:>23} {r['floor_ms'] or 0:9.1f} {r['weights_gbs'] or 0:5.1f} "
              f"{'=' if r['bits_equal_reference'] else '≠'}")
    print("\nper round: ms (% GEMM)")
    for r in rows:
        print(f"{r['config']:6} {r['rows']:5} {r['threads']:3} {r['path']:9} "
              + " ".join(f"{t:.1f} ({p:.1f})" for t, p in zip(r["ms_rounds"], r["pct_rounds"])))
    print(json.dumps({"bench": "experts_cpu", "amx": amx, "rows": rows}))


if __name__ == "__main__":
    main()
