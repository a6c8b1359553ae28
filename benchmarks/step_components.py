"""Where one CPU denoising step's time goes, per component, against the bf16 GEMM rate of the same run
(issue 15 item 5). The 200 M bf16 random checkpoint of bench_cpu_step.py, canvas 256, prompt 32, a middle
step (soft embedding in and out); 1 and 2 threads in interleaved rounds, medians.

Components (wall time by host timers; CPU ops are synchronous): decoder attention (q/k/v/o GEMMs, the
pass's layout, the paged cache's writes and reads, SDPA), dense MLP, self-conditioning MLP, routed experts
(router + experts), norms / RoPE / elementwise (every RMSNorm, RoPE, residual adds, layer scalars, embedding),
vocabulary pass (head GEMMs, per-tile statistics, soft embedding, draw), accept / renoise / stop. A whole step
is the engine's: the canvas's `forward_pass` (one canvas segment after the prompt's), then `rules.sample_step`;
the instrumented decoder pass is checked bit-equal to that `forward_pass`. FLOPs: matmuls only, 2 per
multiply-add, routed experts at top-k.
Two models side by side, interleaved: `packed` (the weights prepacked for oneDNN, as an eager CPU session runs
them: dgcli/model/packed.py) and `loaded` (the weights as loaded: the step before packing); their steps are
checked bit-equal. `--only packed` skips the second.

    python benchmarks/step_components.py [--threads 1,2] [--rounds 5] [--hf] [--only packed]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_step import (
    CANVAS,
    PROMPT_LEN,
    TEXT,
    bench_model,
    cpu_name,
    decoder_pass,
    load_avg,
    median,
    prompt_cache,
)

ORDER = ("attention", "dense_mlp", "selfcond_mlp", "experts", "norms_rope_elem", "vocab_pass", "accept_renoise")


class Clock:
    def __init__(self):
        self.t = defaultdict(float)
        self.last = time.perf_counter()

    def lap(self, name: str):
        now = time.perf_counter()
        self.t[name] += now - self.last
        self.last = now


def component_flops(cfg, prefix: int) -> dict:
    c, h = cfg.canvas_length, cfg.hidden_size
    f = dict.fromkeys(ORDER, 0.0)
    for i in range(cfg.num_hidden_layers):
        g = cfg.layer(i)
        q, kv = cfg.num_attention_heads * g.head_dim, g.num_kv_heads * g.head_dim
        keys = c + (prefix if g.window is None else min(prefix, g.window - 1))
        f["attention"] += 2 * c * h * (2 * q + kv * (2 if g.has_v_proj else 1)) + 4 * c * keys * q
        f["dense_mlp"] += 6 * c * h * cfg.intermediate_size
        f["experts"] += 2 * c * h * cfg.num_experts + cfg.top_k_experts * 6 * c * h * cfg.moe_intermediate_size
    f["selfcond_mlp"] = 6 * c * h * cfg.self_conditioning_size
    f["vocab_pass"] = 4 * c * cfg.vocab_size * h  # head + soft embedding
    return f


@torch.inference_mode()
def instrumented_step(model, canvas, cache, soft, temp, history, params, uniform, noise):
    """A whole step (batch 1) with a clock: the ops of `forward_pass` for one canvas segment after the prompt
    (dgcli/model/gemma.py), then `rules.sample_step`'s."""
    from dgcli.kernels.dispatch import gelu_mul, vocab_pass
    from dgcli.model.attention import PassLayout, Segment, attend
    from dgcli.model.gemma import apply_rope
    from dgcli.sampling.rules import accept_mask, is_confident, is_stable, push_history

    ck = Clock()
    c, dev = canvas.shape[1], canvas.device
    layout = PassLayout([Segment(0, PROMPT_LEN, c, True)], cache, dev)
    ck.lap("attention")
    sc = model.self_conditioning
    e = model.embed(canvas)
    ck.lap("norms_rope_elem")
    pre = sc.pre_norm(soft)
    ck.lap("norms_rope_elem")
    m = sc.down_proj(gelu_mul(sc.gate_proj(pre), sc.up_proj(pre)))  # as MLP.forward
    ck.lap("selfcond_mlp")
    x = sc.post_norm(e + m).flatten(0, 1)[None]  # [1, C, H]: the pass's rows
    tables = model._tables(layout.positions, x.dtype)
    ck.lap("norms_rope_elem")
    for i, (layer, g) in enumerate(zip(model.layers, model.geometry)):
        attn = layer.self_attn
        xn = layer.input_layernorm(x)
        ck.lap("norms_rope_elem")
        b, t, _ = xn.shape
        d = g.head_dim
        qr = attn.q_proj(xn).view(b, t, -1, d)
        k_raw = attn.k_proj(xn).view(b, t, -1, d)
        v_raw = attn.v_proj(xn).view(b, t, -1, d) if attn.v_proj is not None else k_raw
        ck.lap("attention")
        cos, sin = tables[g.kind]
        q = apply_rope(attn.q_norm(qr), cos, sin).transpose(1, 2)
        k = apply_rope(attn.k_norm(k_raw), cos, sin).transpose(1, 2)
        v = attn.v_norm(v_raw).transpose(1, 2)
        ck.lap("norms_rope_elem")
        o = attn.out(attend(q, k, v, i, layout))
        ck.lap("attention")
        x = x + layer.post_attention_layernorm(o)
        r = x
        xn = layer.pre_feedforward_layernorm(r)
        ck.lap("norms_rope_elem")
        dense = layer.mlp(xn)
        ck.lap("dense_mlp")
        dense = layer.post_feedforward_layernorm_1(dense)
        flat = r.reshape(-1, r.shape[-1])
        ck.lap("norms_rope_elem")
        w, idx = layer.router(flat)
        ck.lap("experts")
        xe = layer.pre_feedforward_layernorm_2(flat)
        ck.lap("norms_rope_elem")
        moe = layer.experts(xe, w, idx).reshape(r.shape)
        ck.lap("experts")
        moe = layer.post_feedforward_layernorm_2(moe)
        x = r + layer.post_feedforward_layernorm(dense + moe)
        x *= layer.layer_scalar
        ck.lap("norms_rope_elem")
    hidden = model.norm(x).view(1, c, -1)
    ck.lap("norms_rope_elem")
    out = vocab_pass(hidden, model.embed_weight, softcap=model.config.final_logit_softcapping,
                     temperature=temp, embed_scale=model.embed_scale, uniform=uniform, want_soft=True)
    ck.lap("vocab_pass")
    accepted = accept_mask(out.entropy, params.entropy_bound)
    next_canvas = torch.where(accepted, out.sample, noise)
    stable = is_stable(history, out.argmax, None)
    stop = stable & is_confident(out.entropy, params.confidence_threshold)
    push_history(history, out.argmax)
    ck.lap("accept_renoise")
    return dict(ck.t), hidden, next_canvas, stop


def whole_step(model, canvas, cache, soft, temp, history, params, uniform, noise, tiles: bool):
    """One denoising step as the engine runs it: the canvas's pass, then `rules.sample_step` (soft out)."""
    from dgcli.sampling.rules import sample_step

    with torch.inference_mode():
        hidden = decoder_pass(model, canvas, cache, PROMPT_LEN, soft)
        return sample_step(model, hidden, temp, history, params, uniform, noise, True, tiles)


def gemm_rate() -> float:
    h = TEXT["hidden_size"]
    best = 0.0
    for m, k, n in [(2048, 2048, 2048), (CANVAS, h, 4 * h), (CANVAS, h, TEXT["vocab_size"] // 4)]:
        a, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        F.linear(a, w)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            F.linear(a, w)
            ts.append(time.perf_counter() - t)
        best = max(best, 2 * m * k * n / median(ts))
    return best


@torch.inference_mode()
def vocab_gemms(hidden, embed) -> float:
    """The vocabulary pass's two GEMMs alone (head per 4096-column tile, soft [N, V]x[V, H])."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    p = torch.empty(rows.shape[0], embed.shape[0], dtype=embed.dtype)
    t = time.perf_counter()
    for lo in range(0, embed.shape[0], 4096):
        F.linear(rows, embed[lo:lo + 4096])
    torch.matmul(p, embed)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/dgemma-bench-200m")
    ap.add_argument("--hf", action="store_true", help="time transformers' step too (generate, 6 steps per round)")
    ap.add_argument("--only", choices=["packed", "loaded"], help="one model instead of both")
    ap.add_argument("--compiled", action="store_true",
                    help="also time the step as `--compile` runs it (decoder and vocabulary tiles through "
                         "torch.compile, weights as loaded), per thread count after a fresh compile, "
                         "alternating with the packed eager step; whole steps only (no components)")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    variants = [args.only] if args.only else ["packed", "loaded"]

    from dgcli.sampling.params import DiffusionEbParams

    models = {}
    for v in variants:
        models[v], n_params = bench_model(Path(args.dir), pack=v == "packed")
    cfg = next(iter(models.values())).config
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    caches = {v: prompt_cache(model, prompt) for v, model in models.items()}
    g = torch.Generator().manual_seed(1)
    canvas = torch.randint(0, cfg.vocab_size, (1, CANVAS), generator=g)
    noise = torch.randint(0, cfg.vocab_size, (1, CANVAS), generator=g)
    soft = (torch.randn(1, CANVAS, cfg.hidden_size, generator=g) * 0.5).bfloat16()
    uniform = torch.rand(1, CANVAS, dtype=torch.float64, generator=g)
    temp = torch.tensor([0.6])
    params = DiffusionEbParams(confidence_threshold=0.0)
    history = torch.full((1, 1, CANVAS), -1, dtype=torch.long)  # [S, B, C]
    ref_hidden = outs = None
    for v, model in models.items():
        with torch.inference_mode():
            hidden = decoder_pass(model, canvas, caches[v], PROMPT_LEN, soft)
        _, inst_hidden, nxt, stop = instrumented_step(model, canvas, caches[v], soft, temp, history.clone(), params,
                                                      uniform, noise)
        assert torch.equal(inst_hidden, hidden), f"{v}: instrumented decoder pass differs from forward_pass"
        if ref_hidden is None:
            ref_hidden, outs = hidden, (nxt, stop)
        else:  # packing must not change a bit
            assert torch.equal(hidden, ref_hidden) and torch.equal(nxt, outs[0]), "packed and loaded steps differ"
    flops = component_flops(cfg, PROMPT_LEN)
    total_flops = sum(flops.values())

    hf = None
    if args.hf:
        from bench_cpu_step import _StepClock
        from transformers import DiffusionGemmaForBlockDiffusion

        hf = DiffusionGemmaForBlockDiffusion.from_pretrained(args.dir, dtype=torch.bfloat16).eval()

        def hf_steps(n=6):
            clock = _StepClock()
            with torch.inference_mode():
                hf.generate(input_ids=prompt, max_new_tokens=CANVAS, max_denoising_steps=n,
                            confidence_threshold=1e-30, streamer=clock)
            drafts = [m for kind, m in clock.marks if kind == "draft"]
            return [b - a for a, b in itertools.pairwise(drafts)]
    data = {t: {v: defaultdict(list) for v in variants} for t in threads}
    gemm = {t: [] for t in threads}
    hf_data = {t: [] for t in threads}
    load0 = load_avg()
    for rnd in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            gemm[t].append(gemm_rate())
            for _ in range(2):
                for v, model in models.items():  # interleaved: the machine's drift hits both alike
                    d, cache = data[t][v], caches[v]
                    s = time.perf_counter()
                    whole_step(model, canvas, cache, soft, temp, history, params, uniform, noise, False)
                    d["step"].append(time.perf_counter() - s)
                    parts, *_ = instrumented_step(model, canvas, cache, soft, temp, history, params, uniform, noise)
                    for k, x in parts.items():
                        d[k].append(x)
                data[t][variants[0]]["vocab_gemms"].append(vocab_gemms(ref_hidden, models[variants[0]].embed_weight))
            if args.hf:
                hf_data[t].extend(hf_steps()[1:])
        print(f"round {rnd} done, load {load_avg()}", file=sys.stderr)
    load1 = load_avg()

    result = {"machine": cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "params_m": n_params / 1e6, "step_gflop": total_flops / 1e9, "load_avg": f"{load0} -> {load1}",
              "rounds": args.rounds, "threads": {}}
    print(f"machine: {cpu_name()}, torch {torch.__version__}, {n_params / 1e6:.1f} M params, "
          f"{total_flops / 1e9:.1f} GFLOP/step (matmuls), load avg {load0} -> {load1}")
    for t in threads:
        rate = median(gemm[t])
        row = {"gemm_gflops": rate / 1e9, "vocab_gemms_ms": median(data[t][variants[0]]["vocab_gemms"]) * 1e3}
        print(f"\n### {t} thread(s): bf16 GEMM rate {rate / 1e9:.0f} GFLOP/s (this run)")
        inst = {}
        for v in variants:
            d = data[t][v]
            step = median(d["step"])
            inst[v] = {k: median(d[k]) for k in ORDER}
            # each round's share (its 2 steps' best against the run's median GEMM rate; a single probe can
            # land in a slow moment of this VM and read half the rate): the spread within the run
            per_round = [total_flops / min(d["step"][2 * r:2 * r + 2]) / rate for r in range(args.rounds)]
            row[v] = {"step_ms": step * 1e3, "step_share_of_gemm": total_flops / step / rate,
                      "share_per_round": per_round, "instrumented_sum_ms": sum(inst[v].values()) * 1e3,
                      "components": {}}
            print(f"{v}: step (median) {step * 1e3:.1f} ms = {total_flops / step / 1e9:.0f} GFLOP/s = "
                  f"{100 * total_flops / step / rate:.1f} % of the GEMM rate; instrumented sum "
                  f"{sum(inst[v].values()) * 1e3:.1f} ms; per round "
                  + ", ".join(f"{100 * x:.1f}" for x in per_round) + " %")
        if len(variants) == 2:
            a, b = (row[v]["step_ms"] for v in variants)
            print(f"packed against loaded: {b / a:.3f}x")
        if hf_data[t]:
            hs = median(hf_data[t])
            row["hf_step_ms"] = hs * 1e3
            print(f"transformers step (median of {len(hf_data[t])}): {hs * 1e3:.0f} ms; ratio to "
                  + ", ".join(f"{v} {hs * 1e3 / row[v]['step_ms']:.2f}x" for v in variants))
        print("| component | GFLOP | " + " | ".join(f"{v}: ms · share · % of GEMM rate" for v in variants)
              + " |\n|---|---|" + "---|" * len(variants))
        for k in ORDER:
            fl, cells = flops[k], []
            for v in variants:
                sec = inst[v][k]
                total = sum(inst[v].values())
                gfs = fl / sec / 1e9 if fl else 0.0
                row[v]["components"][k] = {"ms": sec * 1e3, "share": sec / total, "gflop": fl / 1e9, "gflops": gfs}
                cells.append(f"{sec * 1e3:.1f} · {100 * sec / total:.0f} %"
                             + (f" · {100 * gfs * 1e9 / rate:.0f} %" if fl else ""))
            print(f"| {k} | {fl / 1e9:.2f} | " + " | ".join(cells) + " |")
        print(f"(vocab pass's two GEMMs alone: {row['vocab_gemms_ms']:.1f} ms)")
        result["threads"][t] = row
    if args.compiled:
        step_args = (prompt, canvas, soft, temp, history, params, uniform, noise)
        result["compiled"] = compiled_phase(models, caches, step_args, threads, args, total_flops)
    print(json.dumps(result))


def compiled_phase(models, caches, step_args, threads, args, total_flops) -> dict:
    """The `--compile` step (a third model, weights as loaded) against the eager step, alternating, per thread
    count: inductor's C++ kernels take their OpenMP thread count at compile time, so each count compiles
    afresh (dynamo reset) and warms up before it is timed."""
    import torch._dynamo

    from dgcli.runtime.session import compile_decoder

    prompt, canvas, soft, temp, history, params, uniform, noise = step_args
    eager = "packed" if "packed" in models else "loaded"
    model, _ = bench_model(Path(args.dir))
    compile_decoder(model)
    cache = prompt_cache(model, prompt)
    out = {}
    for t in threads:
        torch.set_num_threads(t)
        torch._dynamo.reset()
        s = time.perf_counter()
        for _ in range(3):
            whole_step(model, canvas, cache, soft, temp, history, params, uniform, noise, True)
        warm = time.perf_counter() - s
        rates, times = [], {"compiled": [], eager: []}
        for _ in range(args.rounds):
            rates.append(gemm_rate())
            for _ in range(2):
                sides = (("compiled", model, cache, True), (eager, models[eager], caches[eager], False))
                for name, m, c, tiles in sides:
                    s = time.perf_counter()
                    whole_step(m, canvas, c, soft, temp, history, params, uniform, noise, tiles)
                    times[name].append(time.perf_counter() - s)
        rate, comp, eag = median(rates), median(times["compiled"]), median(times[eager])
        out[t] = {"gemm_gflops": rate / 1e9, "compiled_step_ms": comp * 1e3, f"{eager}_step_ms": eag * 1e3,
                  "compiled_share_of_gemm": total_flops / comp / rate, "warmup_s": warm}
        print(f"\n{t} thread(s), --compile: bf16 GEMM rate {rate / 1e9:.0f} GFLOP/s; compiled step "
              f"{comp * 1e3:.1f} ms = "
              f"{100 * total_flops / comp / rate:.1f} % of it; {eager} eager step {eag * 1e3:.1f} ms = "
              f"{100 * total_flops / eag / rate:.1f} % ({eag / comp:.3f}x); compile + warm-up {warm:.0f} s")
    return out


if __name__ == "__main__":
    main()
