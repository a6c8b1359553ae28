"""Load time and resident memory of one model as a safetensors checkpoint and as GGUF files (BF16, Q8_0,
Q4_K_M): the bundled tiny model, or the ~200 M bf16 random checkpoint of bench_cpu_step.py (`--model 200m`).

Each load runs in a fresh process: `dgcli.load_model` (what every command's session does before packing), then
one decoder pass over a full canvas (every weight read once, so mapped pages are resident). Reported: load
seconds, peak RSS (VmHWM) during the load, RSS right after it (VmRSS), peak RSS after the pass, minus a process that only imports torch + dgcli, and the
file's bytes. GGUF files are written with `dgemma quantize --type` on first use.

    python benchmarks/gguf_load.py [--model tiny|200m] [--types bf16,q8_0,q4_k_m] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, time, torch
import dgcli
torch.set_num_threads(int(sys.argv[3]))
def rss(key="VmHWM:"):
    # VmHWM: this process image's peak RSS (ru_maxrss would carry the parent's over fork + exec); VmRSS: now.
    line = next(l for l in open("/proc/self/status") if l.startswith(key))
    return int(line.split()[1]) * 1024
if sys.argv[1] == "base":
    print(json.dumps({"maxrss": rss()})); sys.exit(0)
t = time.perf_counter()
m = dgcli.load_model(sys.argv[2])
load_s, at_load, held = time.perf_counter() - t, rss(), rss("VmRSS:")
c = m.config
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    t = time.perf_counter()
    m.forward_canvas(torch.randint(0, c.vocab_size, (1, 32), generator=g),
                     torch.randint(0, c.vocab_size, (1, c.canvas_length), generator=g))
    pass_s = time.perf_counter() - t
print(json.dumps({"load_s": load_s, "at_load": at_load, "held_after_load": held, "after_pass": rss(), "pass_s": pass_s,
                  "dtype": str(m.embed_weight.dtype)}))
"""


def child(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def source(name: str) -> Path:
    if name == "tiny":
        return ROOT / "dgcli" / "data" / "tiny"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    from bench_cpu_step import CANVAS, TEXT
    from dgcli.checkpoint.random_weights import write_random_checkpoint

    path = Path("/tmp/dgemma-bench-200m")
    if not (path / "config.json").exists():
        write_random_checkpoint(path, TEXT, canvas_length=CANVAS, dtype=torch.bfloat16, tokenizer=False)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "200m"])
    ap.add_argument("--types", default="bf16,q8_0,q4_k_m")
    ap.add_argument("--threads", default="1")
    args = ap.parse_args()
    from dgcli.checkpoint.quantize import checkpoint_to_gguf

    src = source(args.model)
    runs = [("safetensors", src, sum(f.stat().st_size for f in src.glob("*.safetensors")))]
    for kind in args.types.split(","):
        dst = Path(f"/tmp/dgemma-gguf-{args.model}-{kind}.gguf")
        if not dst.exists():
            t = time.perf_counter()
            checkpoint_to_gguf(src, dst, kind)
            print(f"wrote {dst} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        runs.append((f"GGUF {kind.upper()}", dst, dst.stat().st_size))
    base = child("base", "", args.threads)["maxrss"]
    rows = []
    print(f"| {args.model} | file MB | load s | peak RSS in load MB | RSS after load MB | peak RSS after one pass MB "
          "| pass s | run dtype |")
    print("|---|---|---|---|---|---|---|---|")
    for label, path, size in runs:
        r = child("load", str(path), args.threads)
        row = {"format": label, "file_bytes": size, **r, "base_rss": base}
        rows.append(row)
        print(f"| {label} | {size / 1e6:.1f} | {r['load_s']:.2f} | {(r['at_load'] - base) / 1e6:.0f} | "
              f"{(r['held_after_load'] - base) / 1e6:.0f} | "
              f"{(r['after_pass'] - base) / 1e6:.0f} | {r['pass_s']:.2f} | {r['dtype'].removeprefix('torch.')} |")
    print(json.dumps({"model": args.model, "threads": int(args.threads), "rows": rows}))


if __name__ == "__main__":
    main()
