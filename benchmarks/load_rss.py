"""Peak resident memory while loading a >= 2 GB checkpoint, against the weights' bytes (goal <= 1.2x).

Three fresh processes so nothing is shared: one writes a random bf16 checkpoint (skipped if present),
one only imports torch + dgcli (the baseline), one loads the checkpoint. Peak RSS is ru_maxrss.

    python benchmarks/load_rss.py [--dir /tmp/dgemma-2gb] [--shards 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TEXT = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
            num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, num_global_key_value_heads=2,
            head_dim=128, global_head_dim=256, num_experts=48, top_k_experts=4, sliding_window=512,
            max_position_embeddings=8192)

CHILD = r"""
import json, resource, sys, time, torch
import dgcli
from dgcli.model.random_weights import write_random_checkpoint
mode, path = sys.argv[1], sys.argv[2]
if mode == "write":
    write_random_checkpoint(path, json.loads(sys.argv[3]), dtype=torch.bfloat16, shards=int(sys.argv[4]), tokenizer=False)
elif mode == "load":
    t = time.perf_counter()
    m = dgcli.load_model(path)
    dt = time.perf_counter() - t
    at_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # Touch every weight once (what the first forward does): mapped pages become resident.
    sum(p.sum().item() for p in m.state_dict().values())
    n = sum(p.numel() * p.element_size() for p in m.state_dict().values())
    print(json.dumps({"load_s": dt, "state_bytes": n, "at_load": at_load, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    sys.exit(0)
print(json.dumps({"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def child(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/dgemma-2gb")
    ap.add_argument("--shards", type=int, default=3)
    a = ap.parse_args()
    path = Path(a.dir)
    if not (path / "config.json").exists():
        t = time.perf_counter()
        child("write", str(path), json.dumps(TEXT), str(a.shards))
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    base = child("baseline", str(path))["maxrss"]
    load = child("load", str(path))
    gb = 1 << 30
    print(f"checkpoint files: {file_bytes / gb:.2f} GiB; model tensors: {load['state_bytes'] / gb:.2f} GiB")
    print(f"baseline RSS (python + torch + dgcli): {base / gb:.2f} GiB")
    print(f"peak RSS right after load_model: {load['at_load'] / gb:.2f} GiB ({load['load_s']:.1f} s; pages are mapped lazily)")
    print(f"peak RSS after touching every weight: {load['maxrss'] / gb:.2f} GiB")
    print(f"peak / weights: {load['maxrss'] / load['state_bytes']:.3f}x; "
          f"(peak - baseline) / weights: {(load['maxrss'] - base) / load['state_bytes']:.3f}x")


if __name__ == "__main__":
    main()
