"""Batched engine on CPU: aggregate throughput per batch size, side by side in one run, against the bf16
matmul rate measured in the same run; then the bundled prompt set through `generate --input-jsonl`
at --batch-size 8 vs 1 (wall time ratio).

Part 1 (fixed work, a ~200 M-parameter bf16 random checkpoint, the shape of bench_cpu_step.py): the same
R requests (random prompts of mixed lengths, their own seeds, one block of S steps each, confidence 0)
through `generate_batch_events` with max_batch 1, 2, 4 and 8, in interleaved rounds (1, 2, 4, 8, 1, 2,
...) so that drift in the machine's load hits every size alike; per size the median over rounds of
committed canvas tokens / wall time, the share of the matmul rate the decoder passes reach, and the
answers (which must be equal at every size: batch invariance).

Part 2: `dgemma generate --input-jsonl heldout.jsonl --format json` at --batch-size 1 and 8, each timed
as a subprocess (model load included, so the ratio understates the loop's own gain), alternating.

    python benchmarks/bench_batch.py [--steps 4] [--requests 8] [--rounds 2] [--threads 2] [--skip-cli]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_step import bench_model, cpu_name, load_avg, matmul_rate, median, step_flops  # noqa: E402


def run_size(model, prompts, seeds, params, max_batch: int) -> dict:
    from dgcli.sampling.events import Done
    from dgcli.engine import generate_batch_events

    stats: dict = {}
    t0 = time.perf_counter()
    dones = {}
    for ev in generate_batch_events(model, prompts, params=params, num_blocks=1, seeds=seeds, max_batch=max_batch,
                                    stats=stats):
        if isinstance(ev, Done):
            dones[ev.row] = ev
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "stats": stats, "answers": [dones[i].token_ids for i in range(len(prompts))],
            "passes_per_request": [dones[i].decoder_passes for i in range(len(prompts))]}


def cli_wall(batch: int) -> float:
    prompts = Path(__file__).resolve().parents[1] / "dgcli" / "data" / "prompts" / "heldout.jsonl"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dgcli.cli", "generate", "--input-jsonl", str(prompts), "--format", "json",
                    "--batch-size", str(batch)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/dgemma-bench-200m")
    ap.add_argument("--skip-cli", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.sizes.split(",")]

    from dgcli.sampling.params import DiffusionEbParams

    model, n_params = bench_model(Path(args.dir), pack=True)  # as a CPU bf16 session runs it
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    lengths = [24 + (7 * i) % 17 for i in range(args.requests)]  # 24..40 tokens
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    seeds = list(range(args.requests))
    params = DiffusionEbParams(max_denoising_steps=args.steps, confidence_threshold=0.0)
    fl = [step_flops(cfg, sum(lengths) // len(lengths), i > 0, i < args.steps - 1) for i in range(args.steps)]
    flops_request = sum(fl)  # one block of S steps per request
    load0 = load_avg()
    rate = matmul_rate()
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load avg {load0}")
    print(f"model: {n_params / 1e6:.1f} M params, bf16, V={cfg.vocab_size}, H={cfg.hidden_size}, C={cfg.canvas_length}; "
          f"{args.requests} requests (prompts {min(lengths)}-{max(lengths)} tokens), 1 block x {args.steps} steps "
          f"(fixed work), {flops_request / args.steps / 1e9:.1f} GFLOP per request-step")
    print(f"bf16 matmul rate (this run): {rate['best_flops'] / 1e9:.0f} GFLOP/s")

    run_size(model, prompts[:2], seeds[:2], DiffusionEbParams(max_denoising_steps=1, confidence_threshold=0.0), 2)  # warm-up
    walls: dict[int, list[float]] = {b: [] for b in sizes}
    answers: dict[int, list] = {}
    last: dict[int, dict] = {}
    for _ in range(args.rounds):
        for b in sizes:
            r = run_size(model, prompts, seeds, params, b)
            walls[b].append(r["wall_s"])
            answers[b] = r["answers"]
            last[b] = r
    tok = args.requests * cfg.canvas_length
    rows = []
    base = None
    for b in sizes:
        w = median(walls[b])
        st = last[b]["stats"]
        thr = tok / w
        base = base or thr
        share = flops_request * args.requests / st["denoise_s"] / rate["best_flops"]
        rows.append({"batch_size": b, "wall_s": w, "walls": walls[b], "committed_tok_per_s": thr,
                     "vs_batch_1": thr / base, "decoder_passes": st["decoder_passes"],
                     "step_ms": st["denoise_s"] / st["decoder_passes"] * 1e3, "matmul_share": share,
                     "same_answers_as_batch_1": answers[b] == answers[sizes[0]]})
    print()
    print("| batch | wall s (median) | committed tok/s | vs batch 1 | decoder passes | ms per pass | share of matmul rate | same answers |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['wall_s']:.2f} | {r['committed_tok_per_s']:.0f} | {r['vs_batch_1']:.2f}x | "
              f"{r['decoder_passes']} | {r['step_ms']:.0f} | {r['matmul_share']:.0%} | {r['same_answers_as_batch_1']} |")
    result = {"date": datetime.date.today().isoformat(), "machine": cpu_name(), "threads": torch.get_num_threads(),
              "load_before": load0, "load_after": load_avg(), "params_m": n_params / 1e6,
              "matmul_gflops": rate["best_flops"] / 1e9, "steps": args.steps, "requests": args.requests, "rows": rows}
    if not args.skip_cli:
        one, eight = [], []
        for _ in range(args.rounds):
            one.append(cli_wall(1))
            eight.append(cli_wall(8))
        result["cli"] = {"batch_1_s": one, "batch_8_s": eight, "ratio_8_vs_1": median(one) / median(eight)}
        print(f"\ngenerate --input-jsonl heldout.jsonl (96 prompts, model load included): --batch-size 1 "
              f"{median(one):.1f} s, --batch-size 8 {median(eight):.1f} s: {median(one) / median(eight):.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
