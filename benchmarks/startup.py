"""Start-up wall time of the CLI against `python -c "import torch"` (goal: generate <= import torch + 0.5 s).

Owns: timing, interleaved (A B C A B C ...) so machine noise hits every command alike, N fresh processes
each of `python -c "import torch"`, `dgemma --version` and `dgemma generate "Reverse: c a t"` (the
bundled model), then medians, the budget check and one JSON line. Must not: time anything in-process, or
use a `dgemma` other than the console script beside sys.executable (the venv under test).

    python benchmarks/startup.py [-n 5] [--prompt "Reverse: c a t"]
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

from harness import cpu_name, emit, fail, median, parser, spread
from harness import wall as timer

BUDGET_S = 0.5  # the allowance over a bare `import torch`


def console_script() -> str:
    """The `dgemma` installed with this interpreter (venv/bin/dgemma), not whatever PATH finds first."""
    exe = Path(sys.executable).with_name("dgemma")
    if not exe.exists():
        fail("startup.py", f"no console script at {exe}; install the package into this environment")
    return str(exe)


def wall(cmd: list[str]) -> float:
    """Seconds from spawn to exit; a failing command aborts the run (a fast failure is no start-up)."""
    dt, r = timer(lambda: subprocess.run(cmd, capture_output=True, text=True, check=False))
    if r.returncode != 0:
        sys.exit(f"startup.py: {' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("-n", "--repeats", type=int, default=5, help="runs of each command (default 5)")
    ap.add_argument("--prompt", default="Reverse: c a t")
    args = ap.parse_args()
    if args.dry_run:
        args.repeats = 1

    dgemma = console_script()
    cmds = {
        "import_torch": [sys.executable, "-c", "import torch"],
        "version": [dgemma, "--version"],
        "generate": [dgemma, "generate", args.prompt],
    }
    if not args.dry_run:
        for cmd in cmds.values():  # one untimed warm-up each: page cache and .pyc files, not start-up work
            wall(cmd)
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for i in range(args.repeats):
        for name, cmd in cmds.items():
            times[name].append(wall(cmd))
        print(f"run {i + 1}/{args.repeats}: " + "  ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()),
              file=sys.stderr)

    med = {k: median(v) for k, v in times.items()}
    limit = med["import_torch"] + BUDGET_S
    ok = med["generate"] <= limit
    print(f"median of {args.repeats} (s):")
    for k, v in med.items():
        print(f"  {k:<13} {v:.3f}  (range {min(times[k]):.3f}-{max(times[k]):.3f})")
    print(f"generate - import torch = {med['generate'] - med['import_torch']:+.3f} s "
          f"(budget +{BUDGET_S:.1f} s): {'PASS' if ok else 'FAIL'}")
    emit({"bench": "startup", "repeats": args.repeats, "cpu": cpu_name(), "python": platform.python_version(),
          "median_s": {k: round(v, 4) for k, v in med.items()}, "spread": {k: spread(v) for k, v in times.items()},
          "runs_s": {k: [round(x, 4) for x in v] for k, v in times.items()}, "budget_s": BUDGET_S, "pass": ok})


if __name__ == "__main__":
    main()
