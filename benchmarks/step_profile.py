"""Where a whole denoising step's time goes on the device: wall time per engine step against the time the GPU
spends in kernels (torch.profiler), the kernels and copies launched per step, and the kernels that take the
most. A step whose GPU time is far below its wall time is bound by the host (Python and launches): what CUDA
graphs remove. On a CPU it reports the same wall time and the top CPU ops instead.

    python benchmarks/step_profile.py [--dummy 26B-A4B] [--layers N] [--batch 1,8] [--steps 6] [--prompt 128]
        [--graphs off,on]

The engine runs fixed work (confidence threshold 0, 2 blocks per request) on random bf16 weights built on the
device; each batch is warmed until every request has taken 3 steps, then timed over --steps engine steps
(synchronized at both ends), then profiled over as many. Prints one JSON line per batch and a table.
Part of benchmarks/gpu_suite.py (step `profile`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dgcli.model.random_weights import dummy_config, random_model
from dgcli.engine import LLMEngine as Engine, Request
from dgcli.sampling.events import Step
from dgcli.sampling.params import DiffusionEbParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_batch(model, batch: int, prompt: int, steps: int, graphs: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    device = model.embed_weight.device
    params = DiffusionEbParams(max_denoising_steps=64, confidence_threshold=0.0)
    engine = Engine(model, slots=batch, max_len=prompt + 2 * model.config.canvas_length, pad_id=0, graphs=graphs)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(3, model.config.vocab_size, (prompt,), generator=g)
        engine.submit(Request(id=i, prompt=ids, params=params, num_blocks=2, seed=i))
    seen = 0
    while seen < 3 * batch:  # prompts encoded and every canvas 3 steps in: the steady state
        seen += sum(isinstance(e, Step) for e in engine.step())
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        list(engine.step())
    _sync(device)
    wall = (time.perf_counter() - t0) / steps * 1e3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            list(engine.step())
        _sync(device)
    gpu = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
    busy = sum(e.duration_ns() for e in gpu) / 1e6 / steps
    by_name: dict[str, float] = {}
    for e in gpu:
        by_name[e.name()] = by_name.get(e.name(), 0.0) + e.duration_ns() / 1e6 / steps
    if not gpu:  # CPU: the top ops by their own time
        by_name = {k.key: k.self_cpu_time_total / 1e3 / steps for k in prof.key_averages()}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"batch": batch, "graphs": graphs, "wall_ms_per_step": round(wall, 2), "gpu_busy_ms_per_step": round(busy, 2) if gpu else None,
            "gpu_busy_share": round(busy / wall, 3) if gpu else None, "launches_per_step": round(len(gpu) / steps, 1),
            "top_ms_per_step": [(name[:70], round(ms, 3)) for name, ms in top]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dummy", default="26B-A4B", help="a config.json or the word 26B-A4B")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--graphs", default="off", help="off, on, or off,on: the engine without / with CUDA graphs")
    args = ap.parse_args(argv)
    raw, _, name = dummy_config(args.dummy, args.layers)
    model = random_model(raw, dtype=torch.bfloat16, device=args.device)
    print(f"model: {name}; device: {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}")
    rows = []
    with torch.inference_mode():
        for b in (int(x) for x in args.batch.split(",")):
            for mode in args.graphs.split(","):
                rows.append(profile_batch(model, b, args.prompt, args.steps, graphs=mode.strip() == "on"))
                print(json.dumps(rows[-1]), flush=True)
    print("\n| batch | graphs | wall ms/step | GPU busy ms/step | busy share | launches/step |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {'on' if r['graphs'] else 'off'} | {r['wall_ms_per_step']} | {r['gpu_busy_ms_per_step']} | {r['gpu_busy_share']} | "
              f"{r['launches_per_step']} |")


if __name__ == "__main__":
    main()
