"""GGML kernels on CPU at the released 26B-A4B's shapes: ms and weight GB/s per linear and per MoE layer, bf16
(F.linear, and oneDNN-packed as an eager bf16 session runs it) vs Q4_K / Q8_0 / Q6_K / Q4_0 / Q5_0 kept quantized
(kernels/ggml_cpu.py: as dispatched, and "T int4" = torch's int4 kernel forced), at 256, 64 and 16 canvas rows,
at 1 and 2 threads; then the error of both int4-form paths against the file's exact weights.

    python benchmarks/bench_ggml.py [--threads 1,2] [--reps 3] [--experts 128] [--rows 256,64,16]
    python benchmarks/bench_ggml.py --skip-linears --q4k-only --old-csrc OLD/ggml_csrc.py   # experts, old C beside
    python benchmarks/bench_ggml.py --crossover [--threads 1,2]   # int4 kernel / GEMV / GEMM path by rows
    python benchmarks/bench_ggml.py --step [--threads 1] [--rounds 2] [--canvas 256]   # whole denoising steps
    python benchmarks/bench_ggml.py --write-200m-config /tmp/200m.json   # for `dgemma bench --dummy ... --weights`
    python benchmarks/bench_ggml.py --quantize [--threads 1,2]   # M values/s of ggml.quantize (`dgemma quantize`)

Weights are random valid blocks (`ggml_quants.random_blocks`), built once; GB/s counts the bytes the kernel's form holds
for the matrices a call reads (for experts: only the routed ones). `--step` runs `dgemma bench --dummy` on the
~200 M config (bench_cpu_step.py's) in fresh processes, bf16 / q4_k / q4_k with the int4 kernel forced at every
row count (the path before the GEMM path existed), alternating, and prints ms per step and peak memory side by
side. A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from dgcli.kernels import ggml_cpu, ggml_native, ggml_q8, linear_cpu, moe_cpu
from dgcli.checkpoint import ggml_quants
from dgcli.model import ggml

H, I, DENSE, E, TOP_K = 2816, 704, 2112, 128, 8
LINEARS = {  # name: (out, in) of the released config's projections
    "q_proj (sliding)": (16 * 256, H), "k_proj (sliding)": (8 * 256, H), "o_proj (sliding)": (H, 16 * 256),
    "q_proj (full)": (16 * 512, H), "mlp gate/up": (DENSE, H), "mlp down": (H, DENSE),
}
ROWS = (256, 64, 16)
# (name, type, out, in) for --crossover: the 200 M config's expert and dense shapes, then the released config's
CROSS_SHAPES = (("200m expert gate_up", 12, 1024, 1024), ("200m expert down", 12, 1024, 512),
                ("26B expert gate_up", 12, 1408, 2816), ("26B expert down Q4_0", 2, 2816, 704),
                ("26B expert down Q5_0", 6, 2816, 704), ("26B expert down Q8_0", 8, 2816, 704),
                ("26B q_proj", 12, 4096, 2816), ("26B v_proj Q6_K", 14, 2048, 2816))
CROSS_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def timed(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def types_for(k: int) -> list[int]:
    return [t for t in (ggml.Q4_K, ggml.Q8_0, ggml.Q6_K, ggml.Q4_0, ggml.Q5_0) if ggml.fits(t, k)]


def bench_linears(threads: int, reps: int, rows_out: list) -> None:
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in LINEARS.items():
        w = torch.randn(n, k, generator=g).bfloat16() * k ** -0.5
        packed = linear_cpu.pack(w)
        forms = {"bf16": (lambda x: F.linear(x, w), n * k * 2)}
        if packed is not None:
            forms["bf16 packed"] = (lambda x: linear_cpu.linear(x, packed), n * k * 2)
        for t in types_for(k):
            m = ggml.QuantLinear(ggml_quants.random_blocks((n,), t, k, g), t, k, n)
            forms[ggml.NAMES[t]] = (m, ggml_cpu.prepared_bytes(t, n, k))
            if t != ggml.Q6_K:
                p = ggml._held(m, "weight")
                forms[f"{ggml.NAMES[t]} int4"] = (lambda x, p=p: ggml_cpu._kernel_int4(x, p),
                                                  ggml_cpu.prepared_bytes(t, n, k))
        for m_rows in ROWS:
            x = torch.randn(m_rows, k, generator=g).bfloat16()
            for form, (fn, nbytes) in forms.items():
                ms = timed(lambda: fn(x), reps)
                rows_out.append({"op": name, "shape": [n, k], "rows": m_rows, "threads": threads, "form": form,
                                 "ms": round(ms, 3), "weight_GBps": round(nbytes / ms / 1e6, 2)})


def _old_native(path: str):
    """The native library built from another kernels/ggml_csrc.py's SOURCE (e.g. `git show
    HEAD~1:kernels/ggml_csrc.py`), same signatures: swapped in for the "(old C)" forms."""
    import runpy

    from dgcli.kernels import native

    src = runpy.run_path(path)["SOURCE"]
    sigs = {n: f.argtypes for n in ("int4_tile", "q6k_tile", "int4_gemv")
            if (f := getattr(ggml_native._native(), n, None)) is not None}
    return native.build("ggml_native_old", src, sigs)


def _with_lib(lib, fn):
    """fn run with `lib` as the native library (the forms alternate, so it is swapped per call)."""
    def run(*a):
        saved = ggml_native._native_lib[:]
        ggml_native._native_lib[:] = [lib]
        try:
            return fn(*a)
        finally:
            ggml_native._native_lib[:] = saved
    return run


def bench_experts(threads: int, reps: int, experts: int, rows_out: list, rows: tuple = ROWS, q4k_only: bool = False,
                  old_csrc: str = "") -> None:
    """One MoE layer at the released shapes per form, forms alternating within each of `reps` rounds (best of).
    q4k_only: bf16 packed and Q4_K + Q4_0 only; old_csrc: that form again on the native code built from another
    ggml_csrc.py."""
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(experts, 2 * I, H, generator=g).bfloat16() * H ** -0.5
    dn = torch.randn(experts, H, I, generator=g).bfloat16() * I ** -0.5
    pgu = [linear_cpu.pack(gu[e]) for e in range(experts)]
    pdn = [linear_cpu.pack(dn[e]) for e in range(experts)]
    forms = {"bf16 grouped_mm": (lambda x, w, i: moe_cpu.experts_segments(x, w, i, gu, dn), 3 * H * I * 2)}
    if pgu[0] is not None and pdn[0] is not None:
        forms["bf16 packed"] = (lambda x, w, i: moe_cpu.experts_packed(x, w, i, pgu, pdn, I), 3 * H * I * 2)
    for label, tg, td in (("Q4_K + Q4_0 (dummy q4_k)", ggml.Q4_K, ggml.Q4_0),
                          ("Q4_K + Q5_0 (llama.cpp Q4_K_M)", ggml.Q4_K, ggml.Q5_0), ("Q8_0", ggml.Q8_0, ggml.Q8_0)):
        m = ggml.QuantExperts(ggml_quants.random_blocks((experts, 2 * I), tg, H, g), tg,
                              ggml_quants.random_blocks((experts, H), td, I, g), td, H, I)
        forms[label] = (m, ggml_cpu.prepared_bytes(tg, 2 * I, H) + ggml_cpu.prepared_bytes(td, H, I))
        if ggml_q8.available():  # as dispatched: int8 x (kernels/ggml_q8.py); beside it the bf16 paths
            forms[f"{label}, bf16 x"] = (lambda x, w, i, m=m: _bf16_x(m, x, w, i), forms[label][1])
        if old_csrc and tg == ggml.Q4_K and td == ggml.Q4_0:
            forms[f"{label} (old C)"] = (_with_lib(_old_native(old_csrc), _bf16_x_of(m)), forms[label][1])
        if q4k_only:
            break
    if q4k_only:
        del forms["bf16 grouped_mm"]
    for n in rows:
        x = torch.randn(n, H, generator=g).bfloat16()
        idx = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(n)])
        w = torch.rand(n, TOP_K, generator=g)
        used = int(torch.unique(idx).numel())
        best = dict.fromkeys(forms, float("inf"))
        for fn in forms.values():  # warm each once
            fn[0](x, w, idx)
        for _ in range(reps):  # forms alternating within a round (a shared machine's load hits them all alike)
            for form, (fn, _) in forms.items():
                t = time.perf_counter()
                fn(x, w, idx)
                best[form] = min(best[form], (time.perf_counter() - t) * 1e3)
        for form, (fn, per_expert) in forms.items():
            ms = best[form]
            rows_out.append({"op": f"experts top-{TOP_K}/{experts}", "shape": [experts, H, I], "rows": n,
                             "threads": threads, "form": form, "ms": round(ms, 2), "experts_used": used,
                             "weight_GBps": round(used * per_expert / ms / 1e6, 2)})
    del pgu, pdn


def _bf16_x(m, *a):
    """m(*a) on the bf16 paths (DGEMMA_GGML_Q8=0): what ran before the int8 path."""
    import os

    saved = os.environ.get("DGEMMA_GGML_Q8")
    os.environ["DGEMMA_GGML_Q8"] = "0"
    try:
        return m(*a)
    finally:
        os.environ.pop("DGEMMA_GGML_Q8") if saved is None else os.environ.__setitem__("DGEMMA_GGML_Q8", saved)


def _bf16_x_of(m):
    return lambda *a: _bf16_x(m, *a)


def crossover(threads: list[int], reps: int, mats: int = 16) -> list[dict]:
    """Torch's int4 kernel vs the native GEMV vs the GEMM path (bf16 tiles + oneDNN) by rows, and bf16 packed
    beside them: ms per matrix, each call on the next of `mats` matrices (cold weights, as experts are), and the
    fewest rows where the GEMM path beat the other two (what GEMM_ROWS / GEMM_ROWS_PLANES / GEMV_ROWS are set
    from). Q6_K rows: its native tile path (as dispatched) against its torch tile path (DGEMMA_GGML_NATIVE=0)."""
    import os

    rows = []
    g = torch.Generator().manual_seed(4)
    for t in threads:
        torch.set_num_threads(t)
        for name, qtype, n, k in CROSS_SHAPES:
            ps = ggml_cpu.prepare(ggml_quants.random_blocks((mats, n), qtype, k, g), qtype, k)
            wb = [linear_cpu.pack(torch.randn(n, k, generator=g).bfloat16()) for _ in range(mats)]
            r = {"op": name, "type": ggml.NAMES[qtype], "shape": [n, k], "threads": t, "ms": {}}
            for m in CROSS_ROWS:
                x = torch.randn(m, k, generator=g).bfloat16()
                xin = torch.cat((x, x), 1) if qtype in ggml_cpu.PLANES else x

                def per_mat(fn):
                    return round(timed(lambda: [fn(ps.expert(e)) for e in range(mats)], reps) / mats, 3)

                if qtype == ggml.Q6_K:
                    os.environ["DGEMMA_GGML_NATIVE"] = "0"
                    torch_tiles = per_mat(lambda p: ggml_cpu.linear(x, p))
                    del os.environ["DGEMMA_GGML_NATIVE"]
                    r["ms"][m] = {"native tiles": per_mat(lambda p: ggml_cpu.linear(x, p)), "torch tiles": torch_tiles}
                else:
                    r["ms"][m] = {"int4 kernel": per_mat(lambda p: ggml_cpu._kernel_int4(x, p)),
                                  "gemv": per_mat(lambda p: ggml_native.gemv(xin, p.packed, p.sz, xin.shape[1])),
                                  "gemm path": per_mat(lambda p: ggml_cpu._gemm_int4(x, p))}
                bf = [w for w in wb if w is not None]
                if bf:
                    ms = timed(lambda: [linear_cpu.linear(x, w) for w in bf], reps)
                    r["ms"][m]["bf16 packed"] = round(ms / len(bf), 3)
            r["gemm_wins_from"] = next((m for m, v in r["ms"].items() if "gemm path" in v
                                        and v["gemm path"] < min(v["int4 kernel"], v["gemv"])), None)
            r["gemv_wins_from"] = next((m for m, v in r["ms"].items() if "gemv" in v and v["gemv"] < v["int4 kernel"]),
                                       None)
            rows.append(r)
    return rows


def bench_step(threads: int, rounds: int, canvas: int) -> list[dict]:
    """`dgemma bench --dummy 200m` per form in fresh processes (so peak memory is each form's own), alternating."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from dgcli.checkpoint.random_weights import make_config

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_cpu_step import TEXT

    cfg = Path(tempfile.mkdtemp()) / "config.json"
    cfg.write_text(json.dumps(make_config(TEXT, canvas_length=canvas)))
    args = ["bench", "--dummy", str(cfg), "--diffusion-steps", "8", "--blocks", "1", "--runs", "2", "--warmup", "1",
            "--num-prompts", "1", "--random-input-len", "32", "--threads", str(threads), "--format", "jsonl"]
    force = "import dgcli.kernels.ggml_cpu as g; g.GEMM_ROWS = g.GEMM_ROWS_PLANES = 1 << 30; "
    forms = {"bf16": ("", "bf16"), "q4_k": ("", "q4_k"), "q4_k int4 kernel only": (force, "q4_k")}
    out = []
    for r in range(rounds):
        for form, (pre, weights) in forms.items():
            argv = ["dgemma", *args, "--weights", weights]
            code = f"import sys; {pre}from dgcli import cli; sys.argv = {argv!r}; cli.main()"
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
            if res.returncode:
                raise SystemExit(f"{form}: {res.stderr.strip().splitlines()[-1:]}")
            row = json.loads(res.stdout.strip().splitlines()[-1])
            out.append({"form": form, "round": r, "threads": threads, "canvas": canvas,
                        "ms_per_step": round(row["mean_step_ms"], 1),
                        "peak_MiB": round(row["peak_memory_bytes"] / 2 ** 20, 1)})
            print(json.dumps(out[-1]), flush=True)
    return out


def int4_error() -> dict:
    """Q4_K through the int4 kernel, the GEMM path, the GEMV and the int8 path vs the file's exact weights: weight
    error (scale, zero in bf16) and output error (relative RMS, 256 rows) for zero-mean and mean-1 inputs, beside
    bf16 F.linear of the exact weights (a bf16 checkpoint's error) and Q4_K's own (exact weights vs unquantized)."""
    g = torch.Generator().manual_seed(2)
    n, k = 1408, H
    w0 = torch.randn(n, k, generator=g) * k ** -0.5
    raw = ggml_quants.quantize(w0, ggml.Q4_K)
    w = ggml.dequantize(raw, ggml.Q4_K, k)
    m = ggml.QuantLinear(raw, ggml.Q4_K, k, n)
    wk = m.dequantized()

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    out = {"weight_rel_rms_kernel": rel(wk, w), "weight_rel_rms_bf16": rel(w.bfloat16(), w),
           "weight_max_abs_over_row_absmax": float(((wk - w).abs().amax(1) / w.abs().amax(1)).max())}
    p = ggml._held(m, "weight")
    for mean in (0.0, 1.0):
        x = (torch.randn(256, k, generator=g) + mean).bfloat16()
        exact = F.linear(x.float(), w)
        out[f"out_rel_rms_kernel_mean{mean:g}"] = rel(ggml_cpu._kernel_int4(x, p), exact)
        out[f"out_rel_rms_gemm_path_mean{mean:g}"] = rel(ggml_cpu._gemm_int4(x, p), exact)
        gemv = ggml_native.gemv(x, p.packed, p.sz, k)  # the few-rows GEMV, here on all 256 rows
        if gemv is not None:
            out[f"out_rel_rms_gemv_mean{mean:g}"] = rel(gemv[:, :n], exact)
        int8 = ggml_q8.product(x, p.packed, p.sz, p.k)
        if int8 is not None:  # kernels/ggml_q8.py: x rounded to int8 per group of 32
            out[f"out_rel_rms_int8_path_mean{mean:g}"] = rel(int8[:, :n], exact)
        out[f"out_rel_rms_fp32_kernel_weights_mean{mean:g}"] = rel(F.linear(x.float(), wk), exact)
        out[f"out_rel_rms_bf16_linear_mean{mean:g}"] = rel(F.linear(x, w.bfloat16()), exact)
        out[f"out_rel_rms_q4k_itself_mean{mean:g}"] = rel(exact, F.linear(x.float(), w0))  # the quantization's own
    return {k2: round(v, 6) for k2, v in out.items()}


QUANT_SHAPES = ((H, H), (I, H))  # a hidden x hidden matrix and one expert's gate (or up) projection


def bench_quantize(threads: list[int], reps: int) -> list[dict]:
    """ggml.quantize (fp32 N(0, 1/k) rows -> blocks) in M values/s, best of reps, per type, shape and threads."""
    rows = []
    g = torch.Generator().manual_seed(3)
    for shape in QUANT_SHAPES:
        w = torch.randn(*shape, generator=g) * shape[1] ** -0.5
        for t in threads:
            torch.set_num_threads(t)
            for qtype in (ggml.Q4_K, ggml.Q6_K, ggml.Q8_0):
                ms = timed(lambda: ggml_quants.quantize(w, qtype), reps)
                rows.append({"op": "quantize", "shape": list(shape), "threads": t, "form": ggml.NAMES[qtype],
                             "ms": round(ms, 1), "Mvalues_per_s": round(w.numel() / ms / 1e3, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--experts", type=int, default=E, help="experts in the MoE layer (128 as released)")
    ap.add_argument("--skip-experts", action="store_true")
    ap.add_argument("--skip-linears", action="store_true")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)),
                    help="canvas rows of the experts (the linears: 256, 64, 16)")
    ap.add_argument("--q4k-only", action="store_true", help="experts: bf16 packed and Q4_K + Q4_0 only")
    ap.add_argument("--old-csrc", default="", help="experts: Q4_K + Q4_0 again on another ggml_csrc.py's C")
    ap.add_argument("--quantize", action="store_true", help="time ggml.quantize (Q4_K, Q6_K, Q8_0) instead")
    ap.add_argument("--crossover", action="store_true", help="int4 kernel vs GEMV vs GEMM path by rows instead")
    ap.add_argument("--mats", type=int, default=16, help="--crossover: matrices cycled through (cold weights)")
    ap.add_argument("--step", action="store_true", help="whole 200 M steps: bf16 vs q4_k (fresh processes)")
    ap.add_argument("--rounds", type=int, default=2, help="--step: rounds of the forms, alternating")
    ap.add_argument("--canvas", type=int, default=256, help="--step: canvas rows")
    ap.add_argument("--write-200m-config", metavar="PATH", help="write bench_cpu_step.py's ~200 M config.json and exit")
    args = ap.parse_args()
    if args.write_200m_config:
        import sys
        from pathlib import Path

        from dgcli.checkpoint.random_weights import make_config

        sys.path.insert(0, str(Path(__file__).parent))
        from bench_cpu_step import CANVAS, TEXT

        Path(args.write_200m_config).write_text(json.dumps(make_config(TEXT, canvas_length=CANVAS), indent=2))
        return
    if args.step:
        rows = [r for t in args.threads.split(",") for r in bench_step(int(t), args.rounds, args.canvas)]
        print(json.dumps({"step": rows, "torch": torch.__version__}))
        return
    if args.crossover:
        rows = crossover([int(t) for t in args.threads.split(",")], args.reps, args.mats)
        for r in rows:
            print(f"{r['op']} {r['type']} {r['shape']} thr {r['threads']}: GEMV from {r['gemv_wins_from']}, "
                  f"GEMM path from {r['gemm_wins_from']} rows")
            for m, v in r["ms"].items():
                print(f"  {m:4} rows  " + "  ".join(f"{f} {ms:.3f}" for f, ms in v.items()))
        print(json.dumps({"crossover": rows, "torch": torch.__version__}))
        return
    if args.quantize:
        rows = bench_quantize([int(t) for t in args.threads.split(",")], args.reps)
        print(f"{'type':6} {'shape':>12} {'thr':>3} {'ms':>9} {'M values/s':>10}")
        for r in rows:
            print(f"{r['form']:6} {'x'.join(map(str, r['shape'])):>12} {r['threads']:>3} {r['ms']:>9.1f} "
                  f"{r['Mvalues_per_s']:>10.2f}")
        print(json.dumps({"rows": rows, "torch": torch.__version__}))
        return
    rows: list[dict] = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        if not args.skip_linears:
            bench_linears(threads, args.reps, rows)
        if not args.skip_experts:
            bench_experts(threads, args.reps, args.experts, rows, tuple(int(r) for r in args.rows.split(",")),
                          args.q4k_only, args.old_csrc)
    print(f"{'op':34} {'rows':>4} {'thr':>3} {'form':32} {'ms':>9} {'GB/s':>7}")
    for r in rows:
        print(f"{r['op']:34} {r['rows']:>4} {r['threads']:>3} {r['form']:32} {r['ms']:>9.3f} {r['weight_GBps']:>7.2f}")
    err = int4_error()
    print("int4 path error:", json.dumps(err))
    print(json.dumps({"rows": rows, "int4_error": err, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
