"""Load time and resident memory of one model in each of its forms: the safetensors checkpoint and GGUF files
written from it (`dgemma quantize --type`), against the files' bytes (goal: peak <= 1.2x the file).

Models: the bundled tiny one (`--model tiny`), the ~200 M bf16 random checkpoint (`200m`: benchmarks/200m.json), or
a >= 1 GB one (`1b`: 1.06 B parameters, 2.1 GB in bf16; `--weights fp8`: 56 experts, 1.26 GB as a compressed-tensors
FP8-dynamic checkpoint whose experts stay at one byte). Random checkpoints are written once, under /tmp.

Each load runs in a fresh process: `dgcli.load_model` (what every command's session does before packing), then
every byte of every tensor touched once (a first forward's reads: mapped pages become resident), then one decoder
pass over a canvas. Reported per form: the file's bytes, load seconds, peak RSS (VmHWM) during the load, RSS right
after it (VmRSS), peak RSS after touching every weight and after the pass, each minus a process that only imports
torch + dgcli, and peak / file bytes.

    python benchmarks/load_rss.py [--model tiny|200m|1b] [--weights bf16|fp8] [--types bf16,q8_0,q4_k_m] [--threads 1]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import CONFIG_200M, ROOT, card_line, dgemma_exe, emit, gguf_of, machine, parser, random_checkpoint, wall

# 1b: 1.06 B parameters (2.1 GB bf16); fp8: 56 experts, 1.21 B parameters (1.26 GB, the experts at one byte).
TEXT_1B = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
               num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, num_global_key_value_heads=2,
               head_dim=128, global_head_dim=256, num_experts=48, top_k_experts=4, sliding_window=512,
               max_position_embeddings=8192)
EXPERTS_1B = {"bf16": 48, "fp8": 56}

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
state = m.state_dict()
# Chunked max of the raw bytes: no temporary (a uint8 sum would widen the whole tensor to int64).
sum(int(c.max()) for x in state.values() if x.numel() for c in x.reshape(-1).view(torch.uint8).split(1 << 20))
touched = rss()
c = m.config
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    t = time.perf_counter()
    m.forward_canvas(torch.randint(0, c.vocab_size, (1, 32), generator=g),
                     torch.randint(0, c.vocab_size, (1, c.canvas_length), generator=g))
    pass_s = time.perf_counter() - t
print(json.dumps({"load_s": load_s, "at_load": at_load, "held_after_load": held, "touched": touched,
                  "after_pass": rss(), "pass_s": pass_s, "dtype": str(m.embed_weight.dtype)}))
"""


def child(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def source(name: str, weights: str, root: Path) -> Path:
    """The checkpoint directory of `name`, written on first use."""
    if name == "tiny":
        return ROOT / "dgcli" / "data" / "tiny"
    if name == "200m":
        return random_checkpoint(CONFIG_200M, root, weights)
    path = root / f"dgemma-bench-1b-{weights}"
    if not (path / "config.json").exists():
        import torch

        from dgcli.checkpoint.random_weights import write_random_checkpoint

        text = {**TEXT_1B, "num_experts": EXPERTS_1B[weights]}
        secs, _ = wall(lambda: write_random_checkpoint(path, text, dtype=torch.bfloat16, shards=3, tokenizer=False,
                                                      weights="fp8" if weights == "fp8" else "plain"))
        print(f"wrote {path} in {secs:.1f} s", file=sys.stderr)
    return path


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="tiny", choices=["tiny", "200m", "1b"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8"], help="the safetensors checkpoint's form")
    ap.add_argument("--types", default="bf16,q8_0,q4_k_m", help="GGUF types to write and load ('' for none)")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--dir", default="/tmp", help="where random checkpoints and GGUF files are kept")
    args = ap.parse_args()
    root = Path(args.dir)
    if args.dry_run:  # the bundled model, its safetensors and one GGUF, written to a fresh folder
        args.model, args.weights, args.types, root = "tiny", "bf16", "q8_0", Path(tempfile.mkdtemp())
    src = source(args.model, args.weights, root)
    label = "safetensors" + ("" if args.model == "tiny" else f" {args.weights}")
    runs = [(label, src, sum(f.stat().st_size for f in src.glob("*.safetensors")))]
    for kind in filter(None, args.types.split(",")):
        dst = gguf_of(src, kind) if args.model != "tiny" else root / f"tiny-{kind}.gguf"
        if args.model == "tiny" and not dst.exists():  # the bundled model's folder stays as shipped
            subprocess.run([dgemma_exe(), "quantize", str(src), str(dst), "--type", kind], check=True,
                           capture_output=True)
        runs.append((f"GGUF {kind.upper()}", dst, dst.stat().st_size))
    card = machine(peaks=False)
    print(card_line(card))
    base = child("base", "", args.threads)["maxrss"]
    mb = 1e6
    print(f"\n| {args.model} | file MB | load s | peak RSS in load MB | RSS after load MB | peak RSS, every weight "
          "touched MB | peak RSS after one pass MB | peak / file | pass s | run dtype |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for label, path, size in runs:
        r = child("load", str(path), args.threads)
        rows.append({"format": label, "file_bytes": size, **r, "base_rss": base,
                     "peak_over_file": (r["touched"] - base) / size})
        print(f"| {label} | {size / mb:.1f} | {r['load_s']:.2f} | {(r['at_load'] - base) / mb:.0f} | "
              f"{(r['held_after_load'] - base) / mb:.0f} | {(r['touched'] - base) / mb:.0f} | "
              f"{(r['after_pass'] - base) / mb:.0f} | {rows[-1]['peak_over_file']:.2f}x | {r['pass_s']:.2f} | "
              f"{r['dtype'].removeprefix('torch.')} |")
    emit({"card": card, "model": args.model, "weights": args.weights, "threads": int(args.threads), "rows": rows})


if __name__ == "__main__":
    main()
