"""The GPU suite: everything a CUDA machine should run, in one command, written up as one RESULTS.md section.

On a CUDA machine (`python benchmarks/gpu_suite.py`):
  1. env          the device, driver, torch / triton versions;
  2. tests        the whole test suite (on CUDA the kernel tests run the compiled Triton kernels, not the
                  interpreter: that is where the bf16 tensor-core paths `DOT_BF16` first run);
  3. kernels      tests/kernels again on their own, so their result stands out in the section;
  4. sync_check   host syncs inside a pass: the engine as CUDA runs it (lag 1) with only the pass launch
                  under torch's sync debug mode "error" (benchmarks/sync_check.py --graphs: the replays too;
                  CUDA only, prints one
                  line and passes elsewhere);
  5. engine_passes  a step's time and allocations as the prefix grows, and the step gaps of running requests
                  when a long prompt arrives (benchmarks/engine_passes.py, dummy-medium cut to 6 layers;
                  it runs on the CPU on either plan: the engine's CPU path);
  6. profile      a whole step's wall time against the GPU's busy time and launches per step (torch.profiler;
                  benchmarks/step_breakdown.py --profile: 26B-A4B at batch 1 and 8, graphs off and on; how far the host
                  bounds the step);
  7. bench_kernels  per-kernel time, achieved TFLOP/s and GB/s against the device's peaks, and a step's time
                  per component on 2 layers of the 26B-A4B dummy at batch 1/4/8 (benchmarks/bench_kernels.py;
                  eager: graphs on and off are the profile step's axis);
  8. bench_dummy  `dgemma bench --dummy 26B-A4B` at batch 1/4/8, bf16, fixed work;
     bench_graphs  the same with --cuda-graphs (CUDA only);
  9. bench_bundled  `dgemma bench` on the bundled model (quality and speed on the device).
Each step runs as a subprocess with a time limit; a failing step is recorded (exit code and the tail of its
output) and the suite goes on. The section goes to stdout and, with `--out FILE`, to FILE (append it to
benchmarks/RESULTS.md by hand after reading it).

A 15-minute lease: `--lease` runs the lease plan instead, its limits summing to at most LEASE_S (8 minutes, so a
rerun still fits): the env line; the Triton kernel tests, compiled (the bf16 tensor-core branches run first here);
`dgemma bench --dummy 26B-A4B` at batch 1 and 8 in bf16 and FP8 (weight-only), prompts of 128 and 1,000 tokens,
eager and with CUDA graphs; graphs against eager, bit for bit (benchmarks/graphs_equal.py); the sync check with
graphs. Its dry run prints the total. A step that cannot run here (CUDA only, no budget left, or a script that
printed {"skipped": ...}) is "not run" in the section and never a pass: the suite exits 1 unless every step passed.

The lease's wheelhouse (the device image has its own CUDA torch and Triton, maybe not the rest): build it here with
`python benchmarks/wheelhouse.py .whl` (benchmarks/wheelhouse.py says what goes in), carry `.whl`, and run
`python3 benchmarks/gpu_suite.py --lease --wheels .whl`: its first step, install, puts the wheels in offline, torch
untouched, and prints the env. A CUDA run on a CPU-only torch stops at once with one line.

Also for a short lease: `--budget S` shares S seconds among the steps in order (a step's limit is
its own or what is left; steps past the budget are listed as not run; `--cap kernels=120,...` caps single steps),
`--workers N` runs the pytest steps on N
processes (pytest-xdist, where installed), `-k EXPR` narrows the tests step (`-k cuda`: the tests that run on the
GPU), and `--log-dir DIR` writes each step's whole output and the section so far as each step ends, so a lease
cut short still leaves what ran.

On this CPU-only machine: `--device cpu` runs the same steps at CPU sizes (kernel tests in the Triton
interpreter, `--small` kernel shapes, a 2-layer slice of the medium dummy config instead of 26B-A4B), and
`--dry-run` prints the plan (every command) without running anything. `--only a,b` picks steps.

    python benchmarks/gpu_suite.py [--device cuda|cpu] [--lease [--wheels DIR]] [--dry-run] [--only env,tests,...]
        [--out FILE] [--budget S] [--cap STEP=S,...] [--workers N] [-k EXPR] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, bench_kernels, step_breakdown
from harness import ROOT, emit, wall  # noqa: E402

# The bars a batch-1 step is held to on an H100 (issue 25's text): our floor estimate for the bf16 step, and
# vLLM's published FP8 figure (a 256-token canvas every ~146 ms for 16 steps, ~9 ms per pass).
STEP_FLOOR_MS, VLLM_PASS_MS = 14.0, 9.0
STEPS = ("env", "tests", "kernels", "sync_check", "engine_passes", "profile", "bench_kernels", "bench_dummy",
         "bench_graphs", "bench_bundled")


LEASE_S = 480  # the lease plan's limits in all: 8 of a lease's 15 minutes
LEASE_KERNEL_TESTS = ("test_kernel_fused.py", "test_kernel_rmsnorm.py", "test_kernel_moe.py", "test_paged_attention.py",
                      "test_paged_attention_split.py", "test_kernel_vocab_pass.py", "test_fp8_kernels.py",
                      "test_custom_ops.py")


def lease_plan(device: str, workers: int = 1, wheels: str | None = None) -> dict[str, tuple[list[str], int, dict]]:
    """The lease plan (module docstring), as `plan`'s steps; CUDA-only steps are absent on CPU. `wheels`: the first
    step installs that wheelhouse (and prints the env)."""
    py, cuda = sys.executable, device.startswith("cuda")
    dummy = ["--dummy", "26B-A4B"] if cuda else ["--dummy", str(ROOT / "benchmarks/dummy-medium.json"), "--layers", "2"]
    bench = [py, "-m", "dgcli.cli", "bench", "--device", device, "--format", "json", "--no-measure-peaks", *dummy,
             "--dtype", "bfloat16", "--batch-size", "1,8", "--diffusion-steps", "8", "--runs", "1", "--warmup", "1",
             "--num-prompts", "8"]
    first = ("install", [py, "benchmarks/wheelhouse.py", "--install", wheels], 40) if wheels else (
        "env", [py, "benchmarks/gpu_suite.py", "--print-env"], 15)
    steps = {first[0]: (first[1], first[2], {}),
             "kernels": (_pytest(workers) + [f"tests/kernels/{f}" for f in LEASE_KERNEL_TESTS], 120,
                         {} if cuda else {"TRITON_INTERPRET": "1"})}
    for weights in ("bf16", "fp8"):
        for n in (128, 1000):
            for graphs in (False, True) if cuda else (False,):
                steps[f"bench_{weights}_p{n}_{'graphs' if graphs else 'eager'}"] = (
                    bench + ["--weights", weights, "--random-input-len", str(n)] + ["--cuda-graphs"] * graphs, 30, {})
    steps["graphs_equal"] = ([py, "benchmarks/graphs_equal.py"], 40, {})
    steps["sync_check"] = ([py, "benchmarks/sync_check.py"] + ["--graphs"] * cuda, 40, {})
    return steps


def _pytest(workers: int) -> list[str]:
    # pytest with the checkout off sys.path, as the README's test command (the entry point beside the interpreter,
    # else -P): `python -m pytest` would put it there, where kernels/ hides the PyPI `kernels` transformers imports
    entry = Path(sys.executable).with_name("pytest")
    pytest = ([str(entry)] if entry.exists() else [sys.executable, "-P", "-m", "pytest"]) + ["-q", "-p", "no:cacheprovider"]
    return pytest + (["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") is not None else [])


def plan(device: str, workers: int = 1, k: str | None = None) -> dict[str, tuple[list[str], int, dict]]:
    """step -> (argv, time limit in seconds, extra environment). `workers` > 1 runs the pytest steps on that many
    processes (pytest-xdist, where installed); `k` narrows the tests step (pytest -k)."""
    py = sys.executable
    cuda = device.startswith("cuda")
    # CUDA: the real config at batch 1/4/8; CPU: two layers of the medium dummy config, one run.
    dummy = ["--dummy", "26B-A4B"] if cuda else ["--dummy", str(ROOT / "benchmarks/dummy-medium.json"), "--layers", "2"]
    bench = [py, "-m", "dgcli.cli", "bench", "--device", device, "--format", "json", "--no-measure-peaks"]
    interp = {} if cuda else {"TRITON_INTERPRET": "1"}
    dummy_run = bench + dummy + ["--dtype", "bfloat16", "--batch-size", "1,4,8", "--diffusion-steps", "16",
                                 "--runs", "3" if cuda else "1", "--warmup", "1", "--num-prompts",
                                 "8" if cuda else "4", "--random-input-len", "128" if cuda else "32"]
    pytest = _pytest(workers)
    # The ahead-of-time compile check is the same on any machine (CI runs it): not worth a lease's minutes.
    aot = ["--ignore", "tests/kernels/test_kernel_targets.py"] if cuda else []
    steps = {
        "env": ([py, "benchmarks/gpu_suite.py", "--print-env"], 60, {}),
        "tests": (pytest + (["-k", k] if k else []), 3600, interp),
        "kernels": (pytest + ["tests/kernels"] + aot, 1800, interp),
        "sync_check": ([py, "benchmarks/sync_check.py"] + (["--graphs"] if cuda else []), 600, {}),
        "engine_passes": ([py, "benchmarks/engine_passes.py", "--prefix", "--arrival", "--layers", "6"], 1800, {}),
        "profile": ([py, "benchmarks/step_breakdown.py", "--profile", "--device", device] + (
                    ["--batch", "1,8", "--graphs", "off,on"] if cuda else ["--dummy", str(ROOT / "benchmarks/dummy-medium.json"), "--layers", "2", "--batch", "1",
                     "--steps", "2"]), 900, {}),
        # per-kernel TFLOP/s and GB/s against the peaks, then the step's components: 26B-A4B (2 layers) at
        # batch 1/4/8 on CUDA; on CPU the medium config's 2 layers at batch 1 (26B-A4B's would take minutes)
        "bench_kernels": ([py, "benchmarks/bench_kernels.py", "--device", device, "--layers", "2"]
                          + (["--step", "26B-A4B", "--batch", "1,4,8"] if cuda else
                             ["--small", "--reps", "3", "--step", str(ROOT / "benchmarks/dummy-medium.json"),
                              "--batch", "1"]), 1800, {}),
        "bench_dummy": (dummy_run, 3600, {}),
        "bench_bundled": (bench + ["--runs", "3" if cuda else "1"], 1800, {}),
    }
    if cuda:  # the same fixed work with decode-only passes replayed as CUDA graphs
        steps["bench_graphs"] = (dummy_run + ["--cuda-graphs"], 3600, {})
    return steps


def print_env() -> None:
    import torch

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    emit({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
          "triton": tv, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only",
          "host": platform.node()})


def run_step(name: str, argv: list[str], limit: int, env: dict) -> dict:
    def run():  # in its own process group: a step cut at its limit takes its children (pip, pytest workers) along
        p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **env}, start_new_session=True)
        try:
            out, err = p.communicate(timeout=limit)
            return p.returncode, out, out + err
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            return "timeout", out, out + err
    seconds, (code, stdout, out) = wall(run)
    return {"step": name, "command": shlex.join(argv), "exit": code, "seconds": round(seconds, 1),
            "stdout": stdout, "output": out}


def status(r: dict) -> str:
    """'passed', 'failed' or 'not run': a step never started, or one that printed {"skipped": ...} (no CUDA), did
    not run, and is never counted as passed."""
    if r["exit"] == 0:
        return "not run" if '"skipped"' in r.get("stdout", "") else "passed"
    return "not run" if str(r["exit"]).startswith("not run") else "failed"


def _bench_rows(stdout: str) -> list[dict]:
    """The rows of `dgemma bench --format json` (its JSON document is the whole stdout)."""
    try:
        return json.loads(stdout).get("rows", [])
    except (ValueError, AttributeError):
        return []


def section(results: list[dict], device: str) -> str:
    when = datetime.date.today().isoformat()
    lines = [f"## GPU suite ({device}, {when}, {platform.node()})", "",
             f"Command: `python benchmarks/gpu_suite.py --device {device}`.", "",
             "| step | exit | seconds | command | status |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['step']} | {r['exit']} | {r['seconds']} | `{r['command']}` | {status(r)} |")
    counts = {k: [r["step"] for r in results if status(r) == k] for k in ("passed", "failed", "not run")}
    lines += ["", "; ".join(f"{k}: {len(v)}" + (f" ({', '.join(v)})" if v and k != "passed" else "")
                            for k, v in counts.items()) + "."]
    for r in results:
        lines += ["", f"### {r['step']}", ""]
        report = _kernel_report(r.get("stdout", "")) if r["step"] == "bench_kernels" else []
        lines += report
        rows = _bench_rows(r.get("stdout", "")) if r["step"].startswith("bench_") else []
        if rows:
            lines += ["| batch | output_throughput tok/s | mean_ttft_ms | ms/step | quality |",
                      "|---|---|---|---|---|"]
            for row in rows:
                lines.append(f"| {row.get('batch_size')} | {_f(row.get('output_throughput'))} | "
                             f"{_f(row.get('mean_ttft_ms'))} | {_f(row.get('mean_step_ms'))} | "
                             f"{_f(row.get('quality'))} |")
            lines += _against_the_bars(rows, r["step"], device)
        out_lines = r["output"].strip().splitlines()
        if report:  # its tables are above: the tail keeps the other lines (device, shapes, stderr), not the JSON
            out_lines = [x for x in out_lines if not x.startswith(("|", "{"))]
        tail = "\n".join(out_lines[-25:])
        lines += ["```", tail, "```"]
    return "\n".join(lines) + "\n"


def _kernel_report(stdout: str) -> list[str]:
    """bench_kernels' tables rebuilt from its last line (JSON): each kernel's achieved TFLOP/s and GB/s beside
    the device's peaks, and the step's components per batch; [] when there is no such line (a failed run)."""
    lines = stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or "rows" not in doc:
        return []
    import bench_kernels  # torch comes with it: only once a section is being written
    import step_breakdown

    pf, pb = doc.get("peak_flops"), doc.get("peak_bytes_per_s")
    peaks = f"{pf / 1e12:.4g} TFLOP/s bf16, {pb / 1e9:.4g} GB/s" if pf and pb else "unknown"
    out = [f"Device {doc.get('device')}: peaks {peaks} ({doc.get('peak_source')}).", ""]
    if doc["rows"]:
        out += bench_kernels.kernel_table(doc["rows"]) + [""]
    if doc.get("step"):
        out += step_breakdown.step_table(doc["step"]) + [""]
    return out


def _against_the_bars(rows: list[dict], step: str, device: str) -> list[str]:
    """The batch-1 step of the 26B-A4B dummy against STEP_FLOOR_MS and VLLM_PASS_MS (CUDA runs only)."""
    one = next((row for row in rows if row.get("batch_size") == 1), None)
    ms = one.get("mean_step_ms") if one else None
    if not step.startswith("bench_dummy") or not device.startswith("cuda") or not isinstance(ms, (int, float)):
        return []
    return ["", f"Batch 1: {ms:.4g} ms/step = {ms / STEP_FLOOR_MS:.2f}x our bf16 floor estimate "
                f"({STEP_FLOOR_MS:g} ms), {ms / VLLM_PASS_MS:.2f}x vLLM's published FP8 pass (~{VLLM_PASS_MS:g} ms, "
                "H100)."]


def _f(x) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when visible) or cpu")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--lease", action="store_true", help=f"the lease plan: limits within {LEASE_S} s")
    ap.add_argument("--wheels", default=None, help="--lease: first install this wheelhouse (benchmarks/wheelhouse.py)")
    ap.add_argument("--only", default=None, help=f"steps to run, of {','.join(STEPS)} (--lease: its own)")
    ap.add_argument("--out", default=None, help="also write the section to this file")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all steps together (a short lease)")
    ap.add_argument("--cap", default="", help="STEP=SECONDS,... caps single steps' time limits")
    ap.add_argument("--workers", type=int, default=1, help="processes for the pytest steps (pytest-xdist)")
    ap.add_argument("-k", dest="k", default=None, help="pytest -k expression for the tests step")
    ap.add_argument("--log-dir", default=None, help="write each step's output and the section so far here")
    ap.add_argument("--print-env", action="store_true", help=argparse.SUPPRESS)  # the env step itself
    args = ap.parse_args()
    if args.print_env:
        print_env()
        return
    device = args.device
    if device is None or device.startswith("cuda") and not args.dry_run:
        import torch

        device = device or ("cuda" if torch.cuda.is_available() or args.wheels else "cpu")
        if device.startswith("cuda") and not args.dry_run:  # which torch, in one line; a CPU-only one stops here
            if torch.version.cuda is None:
                print(f"gpu_suite: error: torch {torch.__version__} at {torch.__file__} is a CPU-only build: run "
                      "the suite with the device image's python3 (its CUDA torch; the wheelhouse never installs one), "
                      "or pass --device cpu", file=sys.stderr)
                sys.exit(2)
            print(f"gpu_suite: torch {torch.__version__} (CUDA {torch.version.cuda}) at {torch.__file__}",
                  file=sys.stderr)
    names = list(lease_plan("cuda", wheels=args.wheels)) if args.lease else list(STEPS)
    only = [s.strip() for s in (args.only or ",".join(names)).split(",") if s.strip()]
    bad = [s for s in only if s not in names]
    if bad:
        sys.exit(f"gpu_suite: unknown step(s) {', '.join(bad)}; choose from {', '.join(names)}")
    steps = lease_plan(device, args.workers, args.wheels) if args.lease else plan(device, args.workers, args.k)
    try:
        caps = {name: float(sec) for name, sec in (c.split("=") for c in args.cap.split(",") if c.strip())}
    except ValueError:
        sys.exit(f"gpu_suite: --cap {args.cap!r}: give STEP=SECONDS,... (e.g. kernels=120)")
    results, t0 = [], time.perf_counter()
    for name in [n for n in only if n not in steps]:
        print(f"gpu_suite: {name}: CUDA only, not run on {device}", file=sys.stderr)
        results.append({"step": name, "command": "", "exit": f"not run (CUDA only)", "seconds": 0, "stdout": "",
                        "output": f"not run: CUDA only, the device is {device}"})
    only = [n for n in only if n in steps]
    if args.dry_run:
        for name in only:
            argv, limit, env = steps[name]
            pre = " ".join(f"{k}={v}" for k, v in env.items())
            print(f"{name}: {(pre + ' ') if pre else ''}{shlex.join(argv)}  (limit {limit} s)")
        if args.lease:
            total = sum(steps[n][1] for n in only)
            print(f"total {total} s of limits ({'within' if total <= LEASE_S else 'OVER'} the lease's {LEASE_S} s)")
        return
    logs = Path(args.log_dir) if args.log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    for name in only:
        argv, limit, env = steps[name]
        limit = int(min(limit, caps.get(name, limit)))
        if args.budget is not None:
            left = int(args.budget - (time.perf_counter() - t0))
            if left < 10:
                results.append({"step": name, "command": shlex.join(argv), "exit": "not run (budget)", "seconds": 0,
                                "stdout": "", "output": f"not run: the --budget of {args.budget:g} s was spent"})
                continue
            limit = min(limit, left)
        print(f"gpu_suite: {name} …", file=sys.stderr, flush=True)
        results.append(run_step(name, argv, limit, env))
        print(f"gpu_suite: {name}: exit {results[-1]['exit']} in {results[-1]['seconds']} s", file=sys.stderr)
        if logs:
            (logs / f"{name}.log").write_text(results[-1]["output"], encoding="utf-8")
            (logs / "section.md").write_text(section(results, device), encoding="utf-8")
    text = section(results, device)
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    sys.exit(0 if results and all(status(r) == "passed" for r in results) else 1)


if __name__ == "__main__":
    main()
