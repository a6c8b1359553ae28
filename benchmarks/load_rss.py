"""Peak resident memory while loading a large checkpoint, against its bytes (goal <= 1.2x): bf16 (>= 2 GB, the
default) or FP8 (`--weights fp8`: a >= 1 GB compressed-tensors FP8-dynamic checkpoint; the FP8 weights stay at
one byte, the per-expert tensors are read into the fused expert layout without a second copy).

Three fresh processes so nothing is shared: one writes a random checkpoint (skipped if present), one only
imports torch + dgcli (the baseline), one loads the checkpoint and touches every byte of every tensor. Peak
RSS is ru_maxrss (it counts the memory-mapped file pages the model reads).

    python benchmarks/load_rss.py [--weights bf16|fp8] [--dir DIR] [--shards 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# bf16: 1.06 B parameters (2.1 GB); fp8: 56 experts, 1.21 B parameters (1.26 GB, the experts at one byte).
TEXT = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
            num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, num_global_key_value_heads=2,
            head_dim=128, global_head_dim=256, num_experts=48, top_k_experts=4, sliding_window=512,
            max_position_embeddings=8192)
EXPERTS = {"bf16": 48, "fp8": 56}
DIRS = {"bf16": "/tmp/dgemma-2gb", "fp8": "/tmp/dgemma-fp8-1gb"}

CHILD = r"""
import json, resource, sys, time, torch
import dgcli
from dgcli.checkpoint.random_weights import write_random_checkpoint
mode, path = sys.argv[1], sys.argv[2]
if mode == "write":
    write_random_checkpoint(path, json.loads(sys.argv[3]), dtype=torch.bfloat16, shards=int(sys.argv[4]),
                            tokenizer=False, weights=sys.argv[5])
elif mode == "load":
    t = time.perf_counter()
    m = dgcli.load_model(path)
    dt = time.perf_counter() - t
    at_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = m.state_dict()
    # Touch every byte once (what the first forward does): mapped pages become resident. Chunked max of the
    # raw bytes: no temporary (a uint8 sum would widen the whole tensor to int64).
    sum(int(c.max()) for t in state.values() for c in t.reshape(-1).view(torch.uint8).split(1 << 20))
    n = sum(t.numel() * t.element_size() for t in state.values())
    fp8 = sum(t.numel() for t in state.values() if t.dtype == torch.float8_e4m3fn)
    print(json.dumps({"load_s": dt, "state_bytes": n, "fp8_params": fp8, "at_load": at_load,
                      "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    sys.exit(0)
print(json.dumps({"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def child(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", choices=tuple(DIRS), default="bf16")
    ap.add_argument("--dir", default=None, help="default: /tmp/dgemma-2gb (bf16), /tmp/dgemma-fp8-1gb (fp8)")
    ap.add_argument("--shards", type=int, default=3)
    a = ap.parse_args()
    path = Path(a.dir or DIRS[a.weights])
    if not (path / "config.json").exists():
        t = time.perf_counter()
        child("write", str(path), json.dumps({**TEXT, "num_experts": EXPERTS[a.weights]}), str(a.shards), a.weights)
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    base = child("baseline", str(path))["maxrss"]
    load = child("load", str(path))
    gb = 1 << 30
    print(f"checkpoint files: {file_bytes / gb:.3f} GiB ({file_bytes / 1e9:.3f} GB); model tensors: "
          f"{load['state_bytes'] / gb:.3f} GiB, {load['fp8_params'] / 1e9:.3f} B parameters in float8_e4m3fn")
    print(f"baseline RSS (python + torch + dgcli): {base / gb:.3f} GiB")
    print(f"peak RSS right after load_model: {load['at_load'] / gb:.3f} GiB ({load['load_s']:.1f} s; pages are "
          "mapped lazily)")
    print(f"peak RSS after touching every weight: {load['maxrss'] / gb:.3f} GiB")
    print(f"peak / file bytes: {load['maxrss'] / file_bytes:.3f}x; "
          f"(peak - baseline) / file bytes: {(load['maxrss'] - base) / file_bytes:.3f}x")


if __name__ == "__main__":
    main()
