"""The denoising step's modes side by side on CPU (issue 15 item 3): the dynamic step (each block's own shapes,
the default), the static-shape step eager, the whole static step through torch.compile (`--compile`), and the
decoder-only compile it replaced (decoder pass + vocabulary tile math compiled, the rest eager). Fixed work
(confidence 0: every block runs its step cap), the 200 M bf16 random checkpoint of bench_cpu_step.py, ragged
prompts, the batched engine; compiled modes run once untimed first (compile). Rounds interleave the modes;
medians of ms per decoder pass (the engine's own `denoise_s / decoder_passes`). Every mode's tokens and step
counts are compared with the static step's and the dynamic step's.

    python benchmarks/bench_capture.py [--batch 1,4] [--rounds 3] [--threads N] [--modes dynamic,static,compile,decoder]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_cpu_step import bench_model, cpu_name, load_avg, median  # noqa: E402

from dgcli.sampling.events import Done  # noqa: E402
from dgcli.sampling.loop import generate_batch_events  # noqa: E402
from dgcli.sampling.params import DiffusionEbParams  # noqa: E402

PARAMS = DiffusionEbParams(max_denoising_steps=6, confidence_threshold=0.0)
BLOCKS = 2


def run(model, prompts, mode: str, batch: int) -> tuple[float, dict]:
    """(ms per decoder pass, {row: (tokens, steps per block)}) of one fixed-work run."""
    stats: dict = {}
    step_mode, tiles = ("dynamic", True) if mode == "decoder" else (mode, False)
    done = {e.row: (e.token_ids, e.steps_per_block) for e in generate_batch_events(
        model, prompts, params=PARAMS, num_blocks=BLOCKS, max_batch=batch, stats=stats, step_mode=step_mode,
        compile_tiles=tiles) if isinstance(e, Done)}
    return 1e3 * stats["denoise_s"] / stats["decoder_passes"], done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--modes", default="dynamic,static,compile,decoder")
    ap.add_argument("--dir", default="/tmp/dgemma-bench-200m")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    model, n_params = bench_model(Path(a.dir))
    decoder_model = None
    if "decoder" in modes:  # the old --compile mutates the model: a second copy
        from dgcli.runtime.session import compile_decoder

        decoder_model, _ = bench_model(Path(a.dir))
        compile_decoder(decoder_model)
    g = torch.Generator().manual_seed(0)
    v = model.config.vocab_size
    rows = []
    for b in (int(x) for x in a.batch.split(",")):
        prompts = [torch.randint(0, v, (n,), generator=g) for n in [32, 20, 45, 28, 37, 24, 50, 30][:max(b, 1)]]
        first: dict[str, float] = {}
        for m in modes:
            if m in ("compile", "decoder"):
                t = time.perf_counter()
                run(decoder_model if m == "decoder" else model, prompts, m, b)
                first[m] = time.perf_counter() - t
        times: dict[str, list[float]] = {m: [] for m in modes}
        outs: dict[str, dict] = {}
        for _ in range(a.rounds):
            for m in modes:
                ms, outs[m] = run(decoder_model if m == "decoder" else model, prompts, m, b)
                times[m].append(ms)
        base = median(times["dynamic"]) if "dynamic" in times else None
        for m in modes:
            row = {"batch": b, "mode": m, "ms_per_pass": round(median(times[m]), 1),
                   "vs_dynamic": round(base / median(times[m]), 3) if base else None,
                   "first_run_s": round(first[m], 1) if m in first else None,
                   "same_tokens_as_static": outs[m] == outs["static"] if "static" in outs else None,
                   "same_tokens_as_dynamic": outs[m] == outs["dynamic"] if "dynamic" in outs else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(), "params": n_params, "load": load_avg(),
                      "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}))


if __name__ == "__main__":
    main()
