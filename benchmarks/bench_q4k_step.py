"""A Q4_K denoising step against the bf16 step of the same model (issue 27's goal: no slower), side by side.

    python benchmarks/bench_q4k_step.py [--threads 1,2] [--rounds 3] [--canvas 256] [--old OLD/ggml_cpu.py]
    python benchmarks/bench_q4k_step.py --profile [--threads 1]   # where a step's time goes, per form
    python benchmarks/bench_q4k_step.py --per-layer 2,6 [--threads 2] [--rounds 1] [--old ...]   # 26B-A4B, per layer

Each form runs `dgemma bench --dummy` on the ~200 M config (bench_cpu_step.py's; 8 steps, 1 block, 2 runs after
a warmup run of 8) in a fresh process, alternating forms within a round: bf16 (oneDNN-packed, what an eager
session runs), q4_k (kernels/ggml_cpu.py as checked out), q4_k with DGEMMA_GGML_NATIVE=0 (the torch unpacker),
and with --old a ggml_cpu.py from elsewhere (e.g. `git show HEAD~1:kernels/ggml_cpu.py > /tmp/old.py`) loaded in
its place; with --gguf a GGUF file of the same config (`--model FILE`, --ignore-eos: a real Q4_K_M mix with
Q6_K), and with both that file under the old ggml_cpu.py. Prints each run, then per form and thread count the
median ms per step and its ratio to bf16's median; one JSON line last. Run it under `flock /tmp/coord/bench.lock
nice -n 5` on a shared machine. --profile adds exclusive wall time per call kind (summed over the whole process:
warmup, prompt and steps) so the split between unpacking, GEMMs and the experts' loop can be read against bf16's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# In the child: optionally swap kernels/ggml_cpu.py for another file, wrap timers, run the bench in-process.
CHILD = r'''
import collections, contextlib, importlib.util, io, json, sys, time
old, profile, argv = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
if old:
    import dgcli.kernels as K
    spec = importlib.util.spec_from_file_location("dgcli.kernels.ggml_cpu", old)
    mod = importlib.util.module_from_spec(spec); sys.modules["dgcli.kernels.ggml_cpu"] = mod
    spec.loader.exec_module(mod); K.ggml_cpu = mod
from dgcli.kernels import ggml_cpu, linear_cpu, moe_cpu
T, STACK = collections.defaultdict(float), []
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        STACK.append(0.0); t = time.perf_counter(); r = f(*a, **k); dt = time.perf_counter() - t
        T[key] += dt - STACK.pop()
        if STACK: STACK[-1] += dt
        return r
    setattr(obj, name, g)
if profile:
    wrap(linear_cpu, "linear", "packed bf16 GEMM"); wrap(moe_cpu, "experts_packed", "bf16 experts (loop, GEMMs inside)")
    wrap(ggml_cpu, "experts", "q experts loop"); wrap(ggml_cpu, "linear", "q linear dispatch")
    wrap(ggml_cpu, "_kernel_int4", "int4 kernel"); wrap(ggml_cpu, "_int4_tile_t", "torch unpack")
    native = getattr(ggml_cpu, "ggml_native", None)  # kernels/ggml_native.py (absent from an --old ggml_cpu.py)
    if native is not None:
        wrap(native, "packed_linear", "packed bf16 GEMM")
        lib = native._native()
        if lib is not None:
            class Lib:
                def __getattr__(self, name):
                    return getattr(lib, name)
            shim = Lib()
            for fn, key in (("int4_tile", "native unpack"), ("int4_gemv", "native gemv"),
                            ("q6k_tile", "native Q6_K unpack")):
                if hasattr(lib, fn):
                    setattr(shim, fn, getattr(lib, fn)); wrap(shim, fn, key)
            native._native = lambda: shim
from dgcli import cli
sys.argv = ["dgemma", *argv]
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    cli.main()
row = json.loads(buf.getvalue().strip().splitlines()[-1])
print(json.dumps({"ms_per_step": row["mean_step_ms"], "peak_MiB": row["peak_memory_bytes"] / 2 ** 20,
                  "profile_ms": {k: round(v * 1e3, 1) for k, v in sorted(T.items(), key=lambda kv: -kv[1])}}))
'''


def run_form(cfg: Path | str, weights: str, threads: int, old: str, native: bool, profile: bool,
             layers: int = 0) -> dict:
    """One form in a fresh process; `weights` a --dummy --weights format, or "gguf:PATH" (--model PATH);
    `layers`: --layers N, 4 steps (the 26B-A4B per-layer runs)."""
    model = ["--model", weights[5:], "--ignore-eos"] if weights.startswith("gguf:") else \
        ["--dummy", str(cfg), "--weights", weights]
    steps = ["--layers", str(layers), "--diffusion-steps", "4"] if layers else ["--diffusion-steps", "8"]
    argv = ["bench", *model, *steps, "--blocks", "1", "--runs", "2", "--warmup", "1",
            "--num-prompts", "1", "--random-input-len", "32", "--threads", str(threads), "--format", "jsonl"]
    env = dict(os.environ, **({} if native else {"DGEMMA_GGML_NATIVE": "0"}))
    res = subprocess.run([sys.executable, "-c", CHILD, old, "1" if profile else "0", *argv], capture_output=True,
                         text=True, env=env)
    if res.returncode:
        raise SystemExit(res.stderr.strip().splitlines()[-3:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--old", default="", help="another kernels/ggml_cpu.py to run as a q4_k form beside this one")
    ap.add_argument("--profile", action="store_true", help="exclusive time per call kind in each form")
    ap.add_argument("--skip-torch-unpacker", action="store_true", help="leave out the DGEMMA_GGML_NATIVE=0 form")
    ap.add_argument("--gguf", default="", help="a GGUF file of the same config (e.g. `dgemma quantize "
                    "/tmp/dgemma-bench-200m F.gguf --type q4_k_m`) run as more forms (and with --old)")
    ap.add_argument("--per-layer", default="", metavar="L1,L2", help="the 26B-A4B dummy at L1 and L2 layers "
                    "instead (4 steps): ms per layer = the step's difference / (L2 - L1), per form and round")
    args = ap.parse_args()
    if args.per_layer:
        return per_layer(args)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_cpu_step import TEXT

    from dgcli.checkpoint.random_weights import make_config

    cfg = Path(tempfile.mkdtemp()) / "config.json"
    cfg.write_text(json.dumps(make_config(TEXT, canvas_length=args.canvas)))
    forms = {"bf16": ("bf16", "", True), "q4_k": ("q4_k", "", True), "q4_k torch unpacker": ("q4_k", "", False)}
    if args.skip_torch_unpacker:
        del forms["q4_k torch unpacker"]
    if args.old:
        forms["q4_k old"] = ("q4_k", str(Path(args.old).resolve()), True)
    if args.gguf:
        forms["gguf"] = (f"gguf:{Path(args.gguf).resolve()}", "", True)
        if args.old:
            forms["gguf old"] = (f"gguf:{Path(args.gguf).resolve()}", str(Path(args.old).resolve()), True)
    rows = []
    for r in range(args.rounds):
        for t in (int(x) for x in args.threads.split(",")):
            for form, (weights, old, native) in forms.items():
                row = {"form": form, "threads": t, "round": r, "canvas": args.canvas,
                       **run_form(cfg, weights, t, old, native, args.profile)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    summarize(rows, forms, "step")


def summarize(rows: list[dict], forms: dict, unit: str) -> None:
    """Per thread count, each form's median ms per `unit` ("step", "layer") and its ratio to bf16's; the JSON."""
    summary = []
    for t in sorted({row["threads"] for row in rows}):
        med = {f: statistics.median(x[f"ms_per_{unit}"] for x in rows if x["form"] == f and x["threads"] == t)
               for f in forms}
        for f, ms in med.items():
            summary.append({"threads": t, "form": f, f"median_ms_per_{unit}": round(ms, 1),
                            "ratio_to_bf16": round(ms / med["bf16"], 3)})
            print(f"threads {t}  {f:22} {ms:8.1f} ms/{unit}  {ms / med['bf16']:.3f}x bf16")
    print(json.dumps({"runs": rows, "summary": summary}))


def per_layer(args) -> None:
    """bf16, q4_k (and q4_k under --old) on `--dummy 26B-A4B --layers L1|L2`, alternating, each a fresh process:
    ms per layer from the difference of the two step times, median over rounds, and its ratio to bf16's."""
    l1, l2 = (int(x) for x in args.per_layer.split(","))
    forms = {"bf16": ("bf16", ""), "q4_k": ("q4_k", "")}
    if args.old:
        forms["q4_k old"] = ("q4_k", str(Path(args.old).resolve()))
    rows = []
    for r in range(args.rounds):
        for t in (int(x) for x in args.threads.split(",")):
            for form, (weights, old) in forms.items():
                ms = {n: run_form("26B-A4B", weights, t, old, True, False, layers=n)["ms_per_step"] for n in (l1, l2)}
                rows.append({"form": form, "threads": t, "round": r, "ms_per_step": ms,
                             "ms_per_layer": (ms[l2] - ms[l1]) / (l2 - l1)})
                print(json.dumps(rows[-1]), flush=True)
    summarize(rows, forms, "layer")


if __name__ == "__main__":
    main()
