"""Prepacked bf16 weights (kernels/linear_cpu.py) against torch's own GEMM, side by side in one run: GEMM rates
over weights not in cache (the decoder reads each weight once per step), and the routed experts at the
released config's shapes (128 experts top-8, H 2816, I 704) against the grouped path they replace, bits
checked equal in every case, the two run alternately. Prints a card, a table, then one JSON line.

    python benchmarks/bench_packed.py [--threads 2] [--rounds 8] [--real-layers 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_step import cpu_name, decoder_pass, load_avg, median, prompt_cache  # noqa: E402


def timed_pair(a, b, rounds: int) -> tuple[float, float, float]:
    """Median seconds of a and of b, run alternately (this machine's speed drifts by tens of %), and the
    median of the per-round ratios a / b."""
    a(), b()
    ta, tb = [], []
    for _ in range(rounds):
        for fn, ts in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return median(ta), median(tb), median([x / y for x, y in zip(ta, tb)])


def gemm_rows(rounds: int) -> list[dict]:
    from dgcli.kernels.linear_cpu import linear, pack

    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(1024, 1024, generator=g) * 0.03).bfloat16() for _ in range(24)]  # 48 MiB: not cached
    packed = [pack(w) for w in weights]
    rows = []
    for m in (16, 85, 256, 1024):
        x = torch.randn(m, 1024, generator=g).bfloat16()
        assert all(torch.equal(F.linear(x, w), linear(x, p)) for w, p in zip(weights, packed))
        flops = 24 * 2 * m * 1024 * 1024
        plain, fast, ratio = timed_pair(lambda: [F.linear(x, w) for w in weights],
                                        lambda: [linear(x, p) for p in packed], rounds)
        rows.append({"rows": m, "plain_gflops": flops / plain / 1e9, "packed_gflops": flops / fast / 1e9,
                     "speedup": ratio})
    return rows


def expert_rows(rounds: int) -> list[dict]:
    from dgcli.kernels.linear_cpu import pack
    from dgcli.kernels.moe_cpu import experts_packed, experts_segments

    e, k, h, inter = 128, 8, 2816, 704
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(e, 2 * inter, h, generator=g) * 0.02).bfloat16()
    down = (torch.randn(e, h, inter, generator=g) * 0.02).bfloat16()
    gu, dn = [pack(gate_up[i]) for i in range(e)], [pack(down[i]) for i in range(e)]
    rows = []
    for n in (256, 1024):  # one canvas, four
        x = torch.randn(n, h, generator=g).bfloat16()
        w, idx = torch.randn(n, e, generator=g).softmax(-1).topk(k)
        assert torch.equal(experts_segments(x, w, idx, gate_up, down), experts_packed(x, w, idx, gu, dn, inter))
        seg, fast, ratio = timed_pair(lambda: experts_segments(x, w, idx, gate_up, down),
                                      lambda: experts_packed(x, w, idx, gu, dn, inter), rounds)
        rows.append({"tokens": n, "segments_ms": seg * 1e3, "packed_ms": fast * 1e3, "speedup": ratio})
    return rows


def real_layers(n_layers: int, rounds: int) -> dict:
    """The released config's first `n_layers` layers (random bf16 weights, twice): how long packing takes, and
    one batch-1 decoder pass (canvas 256 after a 32-token prompt) as loaded and packed, alternating, bits
    checked equal. Needs ~3.5 GB per layer-pair of RAM."""
    from dgcli.model.packed import pack_for_cpu
    from dgcli.checkpoint.random_weights import dummy_config, random_model

    raw, _, name = dummy_config("26B-A4B", n_layers)
    plain, packed = (random_model(raw, seed=0, dtype=torch.bfloat16) for _ in range(2))
    t = time.perf_counter()
    count = pack_for_cpu(packed)
    pack_s = time.perf_counter() - t
    cfg = plain.config
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, 32), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g)
    soft = (torch.randn(1, cfg.canvas_length, cfg.hidden_size, generator=g) * 0.5).bfloat16()
    with torch.inference_mode():
        caches = [prompt_cache(m, prompt) for m in (plain, packed)]
        assert torch.equal(decoder_pass(plain, canvas, caches[0], 32, soft),
                           decoder_pass(packed, canvas, caches[1], 32, soft))
        a, b, ratio = timed_pair(lambda: decoder_pass(plain, canvas, caches[0], 32, soft),
                                 lambda: decoder_pass(packed, canvas, caches[1], 32, soft), rounds)
    weights = sum(p.numel() * p.element_size() for p in plain.parameters()) - plain.embed_weight.numel() * 2
    return {"model": name, "matrices_packed": count, "pack_s": pack_s, "weights_gb": weights / 1e9,
            "decode_loaded_ms": a * 1e3, "decode_packed_ms": b * 1e3, "speedup": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--real-layers", type=int, default=0,
                    help="also the released config's first N layers: packing time and a batch-1 decoder pass")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dgcli.kernels.linear_cpu import packing_available

    if not packing_available():
        sys.exit("this torch build has no oneDNN bf16 packed linear: nothing to compare")
    load0 = load_avg()
    print(f"machine: {cpu_name()}, torch {torch.__version__}, {args.threads} threads, load avg {load0}")
    gemms, experts = gemm_rows(args.rounds), expert_rows(args.rounds)
    print("\n| [M, 1024]x[1024, 1024], 24 weights | torch GFLOP/s | packed GFLOP/s | speedup (median of rounds) |"
          "\n|---|---|---|---|")
    for r in gemms:
        print(f"| M = {r['rows']} | {r['plain_gflops']:.0f} | {r['packed_gflops']:.0f} | {r['speedup']:.2f}x |")
    print("\n| routed experts, 128 top-8, H 2816, I 704 | grouped (segments) ms | packed ms "
          "| speedup (median of rounds) |\n|---|---|---|---|")
    for r in experts:
        print(f"| {r['tokens']} tokens | {r['segments_ms']:.1f} | {r['packed_ms']:.1f} | {r['speedup']:.2f}x |")
    real = real_layers(args.real_layers, max(2, args.rounds // 2)) if args.real_layers else None
    if real:
        print(f"\n{real['model']}: {real['matrices_packed']} matrices ({real['weights_gb']:.1f} GB) packed in "
              f"{real['pack_s']:.1f} s; batch-1 decoder pass {real['decode_loaded_ms']:.0f} ms as loaded, "
              f"{real['decode_packed_ms']:.0f} ms packed ({real['speedup']:.2f}x)")
    print(json.dumps({"machine": cpu_name(), "threads": args.threads, "torch": torch.__version__,
                      "load_avg": f"{load0} -> {load_avg()}", "gemm": gemms, "experts": experts, "real": real}))


if __name__ == "__main__":
    main()
