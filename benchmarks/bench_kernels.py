"""The per-op kernel table, and a whole-step breakdown: each op's time and achieved TFLOP/s and GB/s against the
device's peaks (dgcli.measure.peaks: the H100/H200 table on CUDA, a brief measurement on a CPU), for the
implementation `kernels.dispatch` picks and for its reference (the same call under DGEMMA_KERNELS=reference);
`--modes auto,torch,reference` adds one row set per DGEMMA_KERNELS mode, so every implementation of an op is
timed in one run. With --step, a denoising step's time per component at several batches
(benchmarks/step_breakdown.py: eager passes, timed between components; graphs on and off: its --profile).

Owns: the kernel cases and their work formulas (`*_work`, pure arithmetic) and the table. Timers, peaks and the
JSON line are benchmarks/harness.py's. Must not: import an implementation (dispatch picks it), change a kernel or
the model, or time while another benchmark runs (use `flock`).

Ops at the real 26B-A4B shapes on CUDA (small ones on CPU or with --small): vocab_pass (head GEMM +
soft-embedding GEMM), experts (grouped MoE), rms_norm, fp8_linear (W8A16 on CUDA; its reference dequantizes
the whole weight per call), paged_attention (the full layer's heads at 4096 keys; on CPU the torch reference
only: the interpreter is too slow to time). Work: useful FLOPs (2 per multiply-add) and compulsory bytes
(inputs read once, outputs written once, FP8 weights 1 byte): achieved/peak is a lower bound on busyness.

    python benchmarks/bench_kernels.py [--small] [--reps 20] [--modes auto,reference] [--peak-tflops X --peak-gbs Y]
        [--step 26B-A4B --layers 2 --batch 1,4,8] [--no-kernels]
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from harness import device_peaks, emit, fail, num, parser, pct, timed

SMALL = dict(n=128, h=512, v=8192, inter=256, e=8, k=2, dense=512, heads=4, kv=2, d=64, context=256)


# ---- work formulas (FLOPs, bytes): pure arithmetic, checked by hand in tests/measure/test_bench_kernels.py ----


def vocab_work(n: int, v: int, h: int, elt: int = 2) -> tuple[int, int]:
    """Head GEMM and soft-embedding GEMM once each; embed read once, hidden in and soft out, 20 B/row of
    sample, argmax, entropy and uniform."""
    return 4 * n * v * h, v * h * elt + 2 * n * h * elt + n * 20


def experts_work(n: int, h: int, inter: int, e: int, k: int, elt: int = 2) -> tuple[int, int]:
    """top-k experts per token (gate, up, down); every expert's weights read once, x in and out, w and idx."""
    return 6 * n * k * h * inter, e * 3 * h * inter * elt + 2 * n * h * elt + n * k * 12


def rms_norm_work(n: int, h: int, elt: int = 2) -> tuple[int, int]:
    return 4 * n * h, 2 * n * h * elt + h * elt


def fp8_linear_work(n: int, k_in: int, n_out: int, elt: int = 2) -> tuple[int, int]:
    """x [n, K] by e4m3 weights [N, K] (1 byte) with one scale per output channel."""
    return 2 * n * n_out * k_in, n_out * k_in + n_out * elt + n * (k_in + n_out) * elt


def paged_attention_work(rows: int, heads: int, keys: int, d: int, kv_heads: int, seqs: int,
                         elt: int = 2) -> tuple[int, int]:
    """QKᵀ and PV over `keys` keys per row: 4·rows·keys·d·heads; bytes: each sequence's K and V read once per
    kv head, q read and the output written once."""
    return 4 * rows * keys * d * heads, 2 * seqs * kv_heads * keys * d * elt + 2 * rows * heads * d * elt


# ---- rates -------------------------------------------------------------------------------------------------


def rates(flops: float, nbytes: float, sec: float, pf: float | None, pb: float | None) -> dict:
    return dict(ms=sec * 1e3, tflops=flops / sec / 1e12, gbs=nbytes / sec / 1e9,
                flop_share=flops / sec / pf if pf else None, bw_share=nbytes / sec / pb if pb else None)


# ---- kernel cases -----------------------------------------------------------------------------------------


def shapes_for(small: bool) -> dict:
    """The benchmark shapes: the real 26B-A4B config's (canvas 256 rows, its full layer's attention heads at
    4096 keys), or SMALL."""
    if small:
        return dict(SMALL)
    from dgcli.checkpoint.config import parse_config
    from dgcli.checkpoint.random_weights import dummy_config

    cfg = parse_config(dummy_config("26B-A4B")[0])
    full = next(g for g in cfg.layers if g.window is None)
    return dict(n=cfg.canvas_length, h=cfg.hidden_size, v=cfg.vocab_size, inter=cfg.moe_intermediate_size,
                e=cfg.num_experts, k=cfg.top_k_experts, dense=cfg.intermediate_size, heads=cfg.num_attention_heads,
                kv=full.num_kv_heads, d=full.head_dim, context=4096)


@contextmanager
def kernels_mode(mode: str | None):
    """DGEMMA_KERNELS=mode while the block runs (dispatch reads it at each call); None: as the caller set it."""
    old = os.environ.get("DGEMMA_KERNELS")
    if mode is not None:
        os.environ["DGEMMA_KERNELS"] = mode
    try:
        yield
    finally:
        if mode is not None and old is None:
            del os.environ["DGEMMA_KERNELS"]
        elif mode is not None:
            os.environ["DGEMMA_KERNELS"] = old


def _in_mode(fn, mode: str):
    def run():
        with kernels_mode(mode):
            return fn()
    return run


def cases(dev: torch.device, s: dict):
    """[(name, impl, make() -> (kernel fn or None, reference fn), (flops, bytes))] at shapes `s`. Every op goes
    through `kernels.dispatch` (the implementation it picks here); its reference is the same call under
    DGEMMA_KERNELS=reference."""
    from dgcli.kernels import dispatch

    bf = torch.bfloat16
    n, h, v, inter, e, k, dense = (s[x] for x in ("n", "h", "v", "inter", "e", "k", "dense"))
    g = torch.Generator(device=dev).manual_seed(0)

    def both(fn):
        return fn, _in_mode(fn, "reference")

    def vocab():
        hidden = torch.randn(1, n, h, device=dev, generator=g).to(bf)
        embed = (torch.randn(v, h, device=dev, generator=g) * 0.02).to(bf)
        kw = dict(softcap=30.0, temperature=torch.tensor(0.6, device=dev), embed_scale=torch.tensor(53.0, device=dev).to(bf),
                  uniform=torch.rand(1, n, device=dev, generator=g, dtype=torch.float64))
        return both(lambda: dispatch.vocab_pass(hidden, embed, **kw))

    def experts(rows=n):
        x = torch.randn(rows, h, device=dev, generator=g).to(bf)
        w, idx = torch.softmax(torch.randn(rows, e, device=dev, generator=g), -1).topk(k, -1)
        gu = (torch.randn(e, 2 * inter, h, device=dev, generator=g) * h**-0.5).to(bf)
        dn = (torch.randn(e, h, inter, device=dev, generator=g) * inter**-0.5).to(bf)
        return both(lambda: dispatch.experts(x, w, idx, gu, dn))

    def fp8_linear():
        fp8 = torch.float8_e4m3fn
        x = torch.randn(n, h, device=dev, generator=g).to(bf)
        w = torch.randn(dense * 2, h, device=dev, generator=g) * h**-0.5  # [N, K]: the dense MLP's gate|up
        sc = (w.abs().amax(-1, keepdim=True) / torch.finfo(fp8).max).to(bf)
        q = (w / sc.float()).to(fp8)
        return both(lambda: dispatch.fp8_linear(x, q, sc))

    def norm():
        x = torch.randn(n, h, device=dev, generator=g).to(bf)
        wt = torch.rand(h, device=dev, generator=g).to(bf)
        return both(lambda: dispatch.rms_norm(x, wt, 1e-6))

    def paged():
        from dgcli.kernels import paged_attention as pa, reference_ops  # the model's attention entry point on CUDA

        heads, kv, d, ctx, block = s["heads"], s["kv"], s["d"], s["context"], 64
        nb = -(-ctx // block)
        tables = torch.randperm(nb, device=dev, generator=g).to(torch.int32)[None]  # one sequence, shuffled
        k_pool = (torch.randn(kv, nb * block, d, device=dev, generator=g) * d**-0.25).to(bf)
        v_pool = torch.randn(kv, nb * block, d, device=dev, generator=g).to(bf)
        q = (torch.randn(n, heads, d, device=dev, generator=g) * d**-0.25).to(bf)
        i32 = dict(device=dev, dtype=torch.int32)
        a = (q, k_pool, v_pool, torch.zeros(n, **i32), torch.zeros(n, **i32), torch.full((n,), ctx, **i32),
             tables, block)
        fast = None
        if dev.type == "cuda":
            t0, tn = pa.row_tiles([n], pa.rows_per_tile(heads, kv, d), dev)
            fast = lambda: pa.paged_attention(*a, tile_row0=t0, tile_rows=tn)  # noqa: E731
        return fast, lambda: reference_ops.paged_attention_reference(*a)

    cuda = dev.type == "cuda"
    return [
        ("vocab_pass", dispatch.implementation("vocab_pass", dev), vocab, vocab_work(n, v, h)),
        ("experts", dispatch.implementation("experts", dev), experts, experts_work(n, h, inter, e, k)),
        ("experts x8 rows", dispatch.implementation("experts", dev), lambda: experts(8 * n),
         experts_work(8 * n, h, inter, e, k)),
        ("rms_norm", dispatch.implementation("rms_norm", dev), norm, rms_norm_work(n, h)),
        ("fp8_linear", dispatch.implementation("fp8_linear", dev), fp8_linear, fp8_linear_work(n, h, 2 * dense)),
        ("paged_attention", "triton" if cuda else "reference (the interpreter is too slow to time)", paged,
         paged_attention_work(n, s["heads"], s["context"], s["d"], s["kv"], 1)),
    ]


def bench_kernel_rows(dev, s, reps: int, reference: bool, pf, pb) -> list[dict]:
    rows = []
    with torch.inference_mode():
        for op, impl, make, (flops, nbytes) in cases(dev, s):
            row = dict(op=op, impl=impl, flops=flops, bytes=nbytes, reference_ms=None)
            try:  # a kernel that fails (first compile on a new GPU) is reported in its row; the rest still run
                fast, ref = make()
                fast = fast or ref  # no kernel on this device: time the reference as the op
                row.update(rates(flops, nbytes, timed(fast, dev, reps), pf, pb))
                if reference and fast is not ref:
                    row["reference_ms"] = timed(ref, dev, max(3, reps // 4), warmup=1) * 1e3
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            rows.append(row)
    return rows


def kernel_table(rows: list[dict]) -> list[str]:
    out = ["| op | impl | ms | TFLOP/s | % peak FLOP/s | GB/s | % peak BW | reference ms |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" not in r:
            out.append(f"| {r['op']} | {r['impl']} | failed: {r.get('error', '?')} | | | | | |")
            continue
        ref = f"{r['reference_ms']:.3f}" if r.get("reference_ms") is not None else "-"
        out.append(f"| {r['op']} | {r['impl']} | {r['ms']:.3f} | {num(r['tflops'])} | {pct(r['flop_share'])} | "
                   f"{num(r['gbs'])} | {pct(r['bw_share'])} | {ref} |")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small kernel shapes (always on CPU)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--peak-gbs", type=float, default=None)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--no-kernels", action="store_true", help="only the step breakdown")
    ap.add_argument("--modes", default=None, metavar="M[,M...]", help="also time the ops under each "
                    "DGEMMA_KERNELS mode (e.g. auto,torch,reference): one row set per mode")
    ap.add_argument("--step", default=None, metavar="SPEC",
                    help="also break down a step of --dummy SPEC (26B-A4B on CUDA; CPU: a small config)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args(argv)
    if args.dry_run:  # tiny shapes, one rep, a 2-layer step of dummy-medium at batch 1
        from harness import TINY

        args.small, args.reps, args.batch, args.prompt, args.layers = True, 1, "1", 16, 2
        args.step = args.step or str(TINY)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        fail("bench_kernels", "no CUDA device here; run with --device cpu (small shapes, CPU figures)")
    if args.step:  # checked before minutes of kernel timing
        from dgcli.errors import UserError
        from dgcli.checkpoint.random_weights import dummy_config

        try:
            batches = [int(b) for b in args.batch.split(",")]
            dummy_config(args.step, args.layers)
        except ValueError:
            fail("bench_kernels", f"--batch {args.batch!r}: give batch sizes like 1,4,8")
        except UserError as e:  # a bad --step config or --layers
            fail("bench_kernels", str(e))
    name, pf, pb, source = ((dev.type, None, None, "--dry-run: not measured") if args.dry_run
                            else device_peaks(dev, args.peak_tflops, args.peak_gbs))
    s = shapes_for(args.small or dev.type == "cpu")
    print(f"device: {name}; peaks: " + (f"{pf / 1e12:.3g} TFLOP/s bf16, {pb / 1e9:.0f} GB/s" if pf else "unknown")
          + f" ({source})")
    rows = []
    if not args.no_kernels:
        print(f"shapes: {s}; reps {args.reps} (median{', CUDA events' if dev.type == 'cuda' else ''})")
        for mode in (args.modes.split(",") if args.modes else [None]):
            with kernels_mode(mode):
                got = bench_kernel_rows(dev, s, args.reps, not args.no_reference, pf, pb)
            rows += [dict(r, mode=mode) if mode else r for r in got]
        print("\n".join(kernel_table(rows)))
    steps = []
    if args.step:
        from step_breakdown import step_breakdown, step_table

        steps = step_breakdown(dev, args.step, args.layers, batches, max(1, args.reps // 4), args.prompt, pf)
        print("\n".join(["", *step_table(steps)]))
    emit({"device": name, "peak_flops": pf, "peak_bytes_per_s": pb, "peak_source": source,
          "shapes": s, "rows": rows, "step": steps})


if __name__ == "__main__":
    main()
