"""Batched engine on CPU, side by side in one run: aggregate throughput per batch size, and the bundled prompt set
through `generate --input-jsonl` at --batch-size 8 vs 1 (wall time ratio).

Part 1 (fixed work, the ~200 M bf16 config benchmarks/200m.json): `dgemma bench --batch-size SIZES` with R random
prompts (one block of S steps each), in interleaved rounds, each a fresh process; per size the median over rounds
of committed canvas tokens per second, its ratio to batch 1's, ms per decoder pass and the share of the matmul rate
`dgemma bench` measured in the same process (dgcli.measure.peaks). Batch invariance of the answers is the tests'
(tests/sampling), not this script's.

Part 2: `dgemma generate --input-jsonl heldout.jsonl --format json` at --batch-size 1 and 8, each timed as a
subprocess (model load included, so the ratio understates the loop's own gain), alternating.

    python benchmarks/bench_batch.py [--steps 4] [--requests 8] [--rounds 2] [--sizes 1,2,4,8] [--threads 2]
        [--skip-cli]
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from harness import CONFIG_200M, TINY, ROOT, card_line, dgemma, dgemma_exe, emit, machine, median, parser, wall

HELDOUT = ROOT / "dgcli" / "data" / "prompts" / "heldout.jsonl"


def cli_wall(batch: int, prompts=HELDOUT) -> float:
    cmd = [dgemma_exe(), "generate", "--input-jsonl", str(prompts), "--format", "json", "--batch-size", str(batch)]
    return wall(lambda: subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT))[0]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", default=str(CONFIG_200M))
    ap.add_argument("--skip-cli", action="store_true")
    args = ap.parse_args()
    prompts, peaks = HELDOUT, ["--measure-peaks"]
    if args.dry_run:
        args.config, args.steps, args.requests, args.rounds, args.sizes = str(TINY), 1, 2, 1, "1,2"
        peaks = ["--no-measure-peaks"]
    card = machine(peaks=False)
    print(card_line(card))
    print(f"config {args.config}: {args.requests} random prompts of 32 ids, 1 block x {args.steps} steps (fixed "
          f"work), batch sizes {args.sizes}, {args.threads} threads, {args.rounds} rounds")
    sizes = [int(b) for b in args.sizes.split(",")]
    by_size: dict[int, list[dict]] = {b: [] for b in sizes}
    for _ in range(args.rounds):
        got = dgemma("bench", "--dummy", args.config, "--batch-size", args.sizes, "--num-prompts", str(args.requests),
                     "--random-input-len", "32", "--diffusion-steps", str(args.steps), "--blocks", "1", "--runs", "1",
                     "--warmup", "1", "--threads", str(args.threads), *peaks, "--format", "jsonl")
        for row in got:
            by_size[row["batch_size"]].append(row)
    rows, base = [], None
    for b in sizes:
        thr = median([r["diffusion_committed_throughput"] for r in by_size[b]])
        base = base or thr
        util = [r["flops_utilization"] for r in by_size[b] if r.get("flops_utilization") is not None]
        rows.append({"batch_size": b, "committed_tok_per_s": thr, "vs_batch_1": thr / base,
                     "rounds": [r["diffusion_committed_throughput"] for r in by_size[b]],
                     "ms_per_pass": median([r["mean_step_ms"] for r in by_size[b]]),
                     "decoder_passes": by_size[b][-1]["batched_decoder_passes"],
                     "matmul_share": median(util) if util else None})
    print("\n| batch | committed tok/s (median) | vs batch 1 | decoder passes | ms per pass | share of matmul rate |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        share = f"{r['matmul_share']:.0%}" if r["matmul_share"] is not None else "n/a"
        print(f"| {r['batch_size']} | {r['committed_tok_per_s']:.0f} | {r['vs_batch_1']:.2f}x | {r['decoder_passes']} | "
              f"{r['ms_per_pass']:.0f} | {share} |")
    result = {"card": card, "config": args.config, "steps": args.steps, "requests": args.requests, "rows": rows}
    if not args.skip_cli:
        if args.dry_run:  # two prompts of the set, not 96
            prompts = Path(tempfile.mkdtemp()) / "heldout.jsonl"
            prompts.write_text("".join(HELDOUT.read_text().splitlines(keepends=True)[:2]))
        try:
            one, eight = [], []
            for _ in range(args.rounds):
                one.append(cli_wall(1, prompts))
                eight.append(cli_wall(8, prompts))
        finally:
            if args.dry_run:
                prompts.unlink()
        result["cli"] = {"batch_1_s": one, "batch_8_s": eight, "ratio_8_vs_1": median(one) / median(eight)}
        print(f"\ngenerate --input-jsonl {prompts.name} (model load included): --batch-size 1 {median(one):.1f} s, "
              f"--batch-size 8 {median(eight):.1f} s: {median(one) / median(eight):.2f}x")
    emit(result)


if __name__ == "__main__":
    main()
