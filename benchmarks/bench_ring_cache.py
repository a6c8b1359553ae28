"""The sliding layers' KV ring (dgcli/model/cache.py) against the every-position buffers it replaced, in one
process: the KV bytes a slot allocates, and the time of a decoder pass (the canvas over a long prefix), of a
commit (one block encoded) and of the prefill, on a small random config whose prefix spans many windows.

"Before" is `model.new_cache(..., rings=False)`: every layer keeps every position, read through the same
code path the model ran before the rings (checked bit-identical to it). Both runs are interleaved
(A B A B ...) and every output is compared bit for bit. Also the KV bytes per slot of the released 26B-A4B
config (dgcli.measure.memory.kv_bytes) at 8K and 128K context.

    python benchmarks/bench_ring_cache.py [--prefix 8192] [--window 256] [--threads 1] [--reps 15]
        [--dtype bfloat16] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dgcli.measure.memory import kv_bytes
from dgcli.model.config import load_config, real_config_path
from dgcli.model.random_weights import make_config, random_model

S, F = "sliding_attention", "full_attention"


def text_config(window: int, prefix: int) -> dict:
    # 5 sliding : 1 full, like the released model, scaled down (a few M parameters).
    return dict(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, num_global_key_value_heads=2,
                head_dim=64, global_head_dim=128, num_experts=8, top_k_experts=2, sliding_window=window,
                max_position_embeddings=max(8192, 2 * prefix), layer_types=[S] * 5 + [F])


def held(cache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.k + cache.v)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def interleaved(fns: dict, reps: int, dev, setup: dict | None = None) -> dict:
    """Median and fastest seconds of each function, run in turn (A B A B ...) after one warm-up each;
    `setup[k]()` runs untimed before each run of fns[k]."""
    times = {k: [] for k in fns}
    for k, fn in fns.items():
        setup and setup[k]()
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            setup and setup[k]()
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--canvas", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    model = random_model(make_config(text_config(a.window, a.prefix), canvas_length=a.canvas), seed=0, dtype=dtype,
                         device=dev)
    cfg, b, c = model.config, a.batch, a.canvas
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (b, a.prefix), generator=g).to(dev)
    canvas = torch.randint(0, cfg.vocab_size, (b, c), generator=g).to(dev)
    block = torch.randint(0, cfg.vocab_size, (b, c), generator=g).to(dev)
    soft = model.embed(torch.randint(0, cfg.vocab_size, (b, c), generator=g).to(dev))
    max_len = a.prefix + c
    caches = {"before (every position)": model.new_cache(b, max_len, rings=False),
              "after (rings)": model.new_cache(b, max_len)}
    prefill = {}
    for name, cache in caches.items():  # the prefill, once each (the longest pass), and its K/V kept
        sync(dev)
        t0 = time.perf_counter()
        model.encode(prompt, cache)
        sync(dev)
        prefill[name] = time.perf_counter() - t0
    outs = {k: model.decode(canvas, cache, soft) for k, cache in caches.items()}
    same = torch.equal(*outs.values())

    saved = {k: ([t.clone() for t in cache.k + cache.v], list(cache.lens)) for k, cache in caches.items()}

    def restore(k):  # the cache as the prefill left it (a commit overwrites ring positions: no undoing it)
        cache, (bufs, lens) = caches[k], saved[k]
        for t, s in zip(cache.k + cache.v, bufs):
            t.copy_(s)
        cache.lens = list(lens)

    dec = interleaved({k: (lambda cache=cache: model.decode(canvas, cache, soft)) for k, cache in caches.items()},
                      a.reps, dev)
    com = interleaved({k: (lambda cache=cache: model.encode(block, cache)) for k, cache in caches.items()}, a.reps,
                      dev, setup={k: (lambda k=k: restore(k)) for k in caches})
    after_commit = [model.decode(canvas, cache, soft) for cache in caches.values()]
    same_commit = torch.equal(*after_commit)
    before, after = caches
    real = load_config(real_config_path())
    result = {
        "device": str(dev), "dtype": a.dtype, "threads": a.threads, "batch": b, "prefix": a.prefix,
        "window": a.window, "canvas": c, "bit_identical": {"after_prefill": same, "after_commit": same_commit},
        "kv_bytes_per_slot": {k: held(cache) // b for k, cache in caches.items()},
        "decode_ms_median_min": {k: [v * 1e3 for v in t] for k, t in dec.items()},
        "decode_ratio_after_over_before": [x / y for x, y in zip(dec[after], dec[before])],
        "commit_ms_median_min": {k: [v * 1e3 for v in t] for k, t in com.items()},
        "commit_ratio_after_over_before": [x / y for x, y in zip(com[after], com[before])],
        "prefill_ms_once": {k: v * 1e3 for k, v in prefill.items()},
        "real_26B_A4B_bf16_kv_per_slot": {n: {"before": kv_bytes(real, n)["was"], "after": kv_bytes(real, n)["total"]}
                                          for n in (8192, 131072)},
    }
    for k in caches:
        print(f"{k:24s} KV/slot {result['kv_bytes_per_slot'][k] / 2**20:8.2f} MiB  decode {dec[k][0] * 1e3:8.2f} ms "
              f"(min {dec[k][1] * 1e3:.2f})  commit {com[k][0] * 1e3:8.2f} ms (min {com[k][1] * 1e3:.2f})  "
              f"prefill {prefill[k] * 1e3:8.1f} ms (once)")
    rd, rc = result["decode_ratio_after_over_before"], result["commit_ratio_after_over_before"]
    print(f"after/before: decode {rd[0]:.3f} (min {rd[1]:.3f}), commit {rc[0]:.3f} (min {rc[1]:.3f}); "
          f"outputs bit-identical after the prefill: {same}, after a commit: {same_commit}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
