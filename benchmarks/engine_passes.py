"""The engine's passes on this CPU: what a denoising step costs as the prefix grows, and what a long prompt
arriving does to the requests already denoising.

1. `--prefix`: one request (fixed work) at prompt lengths 100 and 4,000; in the steady state of its first block,
   the time of a step and the bytes the CPU allocator hands out during one step (every allocation summed, and the
   peak above what was held before), profiled with torch.profiler. With the paged cache no term may grow with
   the prefix but attention's own reads: the bytes per step stay flat, the time grows only by attention.
2. `--arrival`: 4 requests denoise (fixed work); after their 3rd step a 2,000-token prompt is submitted. The
   gaps between consecutive steps of the 4 (their p50, p99 and max over the run), with the prompt encoded in
   chunks (the default: 256 ids a pass) and whole (`--whole`: one chunk, as an engine without chunked prefill).
3. `--bundled`: the bundled tiny model (fp32, its own weights) in a block's steady state (fixed work; prompts of
   30 + i ids, all lengths different), batch 1 and 8: ms per engine step (best of --rounds x 20 steps) and the
   torch calls one step makes (every call through torch's Python API, tensor attribute reads included: a
   TorchFunctionMode counts them). Its per-op overhead is what a tiny model's step is made of.
Runs against whichever dgcli is on the path, so an older checkout can be measured side by side:
    PYTHONPATH=/path/to/old python benchmarks/engine_passes.py --prefix --arrival
Model (1, 2): benchmarks/dummy-medium.json cut to --layers (default 2: sliding + full), random bf16 weights,
1 thread unless --threads. Prints one JSON line per measurement.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from dgcli.checkpoint.random_weights import random_model
from dgcli.engine import LLMEngine as Engine, Request
from dgcli.sampling.events import Step
from dgcli.sampling.params import DiffusionEbParams
from harness import DUMMY_MEDIUM, emit, parser, timed, times


def model_of(layers: int = 2):
    cfg = json.loads(DUMMY_MEDIUM.read_text())
    t = cfg["text_config"]
    t["layer_types"] = t["layer_types"][:layers - 1] + ["full_attention"]
    t["num_hidden_layers"] = layers
    t["max_position_embeddings"] = 16384
    return random_model(cfg, dtype=torch.bfloat16)


def allocated(fn) -> tuple[int, int]:
    """(bytes allocated in total, peak bytes held above the start) while fn runs, from the allocator's events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = peak = total = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        now += e.nbytes()
        total += max(e.nbytes(), 0)
        peak = max(peak, now)
    return total, peak


def prefix(model, p_len: int, steps: int = 6) -> dict:
    params = DiffusionEbParams(max_denoising_steps=64, confidence_threshold=0.0)
    engine = Engine(model, slots=1, max_len=p_len + 256, pad_id=0)
    engine.submit(Request(id=0, prompt=torch.randint(3, 32768, (p_len,)), params=params, num_blocks=2, seed=1))
    seen = 0
    while seen < 3:  # prefill done and the block's first steps taken: the steady state
        seen += sum(isinstance(e, Step) for e in engine.step())
    ms = timed(lambda: [list(engine.step()) for _ in range(steps)], reps=1, warmup=0) / steps * 1e3
    total, peak = allocated(lambda: list(engine.step()))
    return {"bench": "prefix", "prompt": p_len, "ms_per_step": round(ms, 2), "alloc_mib_per_step": round(total / 2**20, 2),
            "peak_mib_per_step": round(peak / 2**20, 2)}


def arrival(model, whole: bool, prompt: int = 2000, steps: int = 24) -> dict:
    params = DiffusionEbParams(max_denoising_steps=steps, confidence_threshold=0.0)
    # --whole: a budget no prompt reaches, so the prompt goes in one pass (an engine without a budget, like the
    # one before the paged cache, encodes a prompt whole anyway)
    kw = {"budget": 1 << 16} if whole and "budget" in Engine.__init__.__code__.co_varnames else {}
    engine = Engine(model, slots=5, max_len=prompt + 256, pad_id=0, **kw)
    for i in range(4):
        engine.submit(Request(id=i, prompt=torch.randint(3, 32768, (40,)), params=params, num_blocks=1, seed=i))
    last: dict[int, float] = {}
    gaps: list[float] = []
    sent = False
    for ev in engine.events():
        if isinstance(ev, Step) and ev.row < 4:
            now = time.perf_counter()
            if ev.row in last:
                gaps.append(now - last[ev.row])
            last[ev.row] = now
            if not sent and ev.row == 3 and ev.step == 3:
                engine.submit(Request(id=9, prompt=torch.randint(3, 32768, (prompt,)), params=params, num_blocks=1,
                                      seed=9))
                sent = True
    top = sorted(gaps)[-6:]
    gaps.sort()
    q = statistics.quantiles(gaps, n=100)
    return {"bench": "arrival", "prefill": "whole" if whole else "chunked", "p50_gap_ms": round(q[49] * 1e3, 1),
            "p99_gap_ms": round(q[98] * 1e3, 1), "max_gap_ms": round(gaps[-1] * 1e3, 1), "gaps": len(gaps),
            "longest_ms": [round(g * 1e3) for g in top]}


def bundled(batch: int, rounds: int = 5) -> dict:
    from torch.overrides import TorchFunctionMode

    import dgcli

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    model = dgcli.open_session().model  # the bundled model as a session runs it (its weights packed or not)
    # every timed step inside the first block (a finished request would leave steps with nothing to do: 0 ms)
    params = DiffusionEbParams(max_denoising_steps=20 * rounds + 8, confidence_threshold=0.0)
    engine = Engine(model, slots=batch, max_len=40 + 2 * model.config.canvas_length, pad_id=0)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.submit(Request(id=i, prompt=torch.randint(3, model.config.vocab_size, (30 + i,), generator=g),
                              params=params, num_blocks=2, seed=i))
    seen = 0
    while seen < 3 * batch:  # prompts encoded and every canvas 3 steps in: the steady state
        seen += sum(isinstance(e, Step) for e in engine.step())
    with Count() as count:
        list(engine.step())
    best = [t / 20 * 1e3 for t in times(lambda: [list(engine.step()) for _ in range(20)], reps=rounds, warmup=0)]
    return {"bench": "bundled", "batch": batch, "ms_per_step": round(min(best), 2),
            "rounds_ms": [round(x, 2) for x in best], "torch_calls_per_step": count.n}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prefix", action="store_true")
    ap.add_argument("--arrival", action="store_true")
    ap.add_argument("--whole", action="store_true", help="--arrival with the prompt encoded in one chunk")
    ap.add_argument("--bundled", action="store_true", help="the bundled model's step at batch 1 and 8")
    ap.add_argument("--rounds", type=int, default=5, help="--bundled: rounds of 20 steps (the best is kept)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2, help="layers of dummy-medium kept (the last one full)")
    ap.add_argument("--prompt", type=int, default=2000, help="--arrival: the arriving prompt's length")
    a = ap.parse_args()
    sizes, steps = (100, 4000), 24
    if a.dry_run:  # every part, small: 2 layers, short prompts, few steps
        a.prefix = a.arrival = a.bundled = True
        a.layers, a.prompt, a.rounds, sizes, steps = 2, 64, 1, (40,), 6
    torch.set_num_threads(a.threads)
    model = model_of(a.layers) if a.prefix or a.arrival else None
    rows = []
    with torch.inference_mode():
        if a.bundled:
            rows += [bundled(b, a.rounds) for b in (1, 8)]
        if a.prefix:
            rows += [prefix(model, n) for n in sizes]
        if a.arrival:
            rows.append(arrival(model, a.whole, a.prompt, steps))
    for r in rows:
        emit(r)


if __name__ == "__main__":
    main()
