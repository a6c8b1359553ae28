"""CPU end-to-end benchmark: dgemma vs transformers' generate at identical work, side by side in one run.

Prints a static card (machine, model, FLOPs per step, the bf16 matmul rate measured now), then a table,
then one JSON line last. Figures:
* the machine's bf16 matmul rate (best of a few GEMM shapes, measured in this run);
* dgemma: median denoising-step time and its achieved FLOP/s as a share of that rate, generate time;
* transformers' `generate` on the same checkpoint, prompt and fixed work (16 steps per block);
* the extra peak memory of the vocabulary pass at V = 262,144, H = 2816, C = 256 (fresh processes,
  peak RSS above the RSS before the call; E random, no model), for the CPU path and the reference.

Fixed work: confidence_threshold 0 for dgemma (the `fixed-work` preset); transformers rejects 0, so it
gets 1e-30, which a random model's mean entropy never undercuts; both step counts are checked.

    python benchmarks/bench_cpu_step.py [--steps 16] [--blocks 1] [--skip-hf] [--skip-memory] [--dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

S, FULL = "sliding_attention", "full_attention"
# ~200 M parameters, 32k vocabulary, 256-token canvas; MoE shaped like a scaled-down 26B-A4B
# (dense MLP plus routed experts in every layer, 5 sliding : 1 full).
TEXT = dict(vocab_size=32768, hidden_size=1024, intermediate_size=1536, moe_intermediate_size=512,
            num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, num_global_key_value_heads=2,
            head_dim=128, global_head_dim=256, num_experts=12, top_k_experts=4, sliding_window=512,
            max_position_embeddings=8192, layer_types=[S] * 5 + [FULL])
CANVAS = 256
PROMPT_LEN = 32


# ---- machine ----------------------------------------------------------------------------------------------


def cpu_name() -> str:
    from dgcli.measure.card import cpu_name  # one /proc/cpuinfo reader

    return cpu_name() or platform.processor() or "unknown"


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def timed(fn, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def matmul_rate() -> dict:
    """Best bf16 GEMM rate over a few shapes (F.linear, weight [out, in] as the model stores it)."""
    h = TEXT["hidden_size"]
    shapes = [(2048, 2048, 2048), (CANVAS, h, 4 * h), (CANVAS, h, TEXT["vocab_size"] // 4)]
    best, rows = 0.0, []
    for m, k, n in shapes:
        a, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        t = median(timed(lambda: F.linear(a, w), reps=9))
        rate = 2 * m * k * n / t
        rows.append({"shape": [m, k, n], "gflops": rate / 1e9})
        best = max(best, rate)
    return {"best_flops": best, "shapes": rows}


def bench_model(path: Path, pack: bool = False):
    """The ~200 M bf16 random checkpoint at `path` (written on first use), loaded: (model, parameters).
    `pack`: its weights prepacked for oneDNN, as an eager CPU session runs them (dgcli/model/packed.py)."""
    import dgcli
    from dgcli.model.packed import pack_for_cpu
    from dgcli.model.random_weights import write_random_checkpoint

    if not (path / "config.json").exists():
        write_random_checkpoint(path, TEXT, canvas_length=CANVAS, dtype=torch.bfloat16, tokenizer=False)
    model = dgcli.load_model(path)
    n_params = sum(p.numel() for p in model.parameters())
    if pack and not pack_for_cpu(model):
        print("note: weights not packed (no oneDNN bf16 here, or its packed GEMM's bits differ)", file=sys.stderr)
    return model, n_params


# ---- work accounting ------------------------------------------------------------------------------------


def step_flops(cfg, prefix: int, with_soft_in: bool, want_soft_out: bool) -> float:
    """Matmul FLOPs of one denoising step over the canvas (2 per multiply-add; routed experts at top-k)."""
    c, h = cfg.canvas_length, cfg.hidden_size
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        g = cfg.layer(i)
        q, kv = cfg.num_attention_heads * g.head_dim, g.num_kv_heads * g.head_dim
        total += 2 * c * h * (2 * q + kv * (2 if g.has_v_proj else 1))  # q, o, k, (v)
        keys = c + (prefix if g.window is None else min(prefix, g.window - 1))
        total += 4 * c * keys * q  # scores and weighted values
        total += 3 * 2 * c * h * cfg.intermediate_size  # dense MLP
        total += 2 * c * h * cfg.num_experts  # router
        total += cfg.top_k_experts * 3 * 2 * c * h * cfg.moe_intermediate_size  # routed experts
    if with_soft_in:
        total += 3 * 2 * c * h * cfg.self_conditioning_size
    total += 2 * c * cfg.vocab_size * h * (2 if want_soft_out else 1)  # head (+ soft embedding)
    return total


# ---- the model's pass, as the engine runs it --------------------------------------------------------------


def prompt_cache(model, prompt: torch.Tensor):
    """A paged cache holding each row of `prompt` [B, P] (one causal segment per row: the engine's prefill of a
    short prompt), with room for a canvas after it."""
    from dgcli.model.attention import Segment

    (b, p), c = prompt.shape, model.config.canvas_length
    cache = model.new_cache(b, p + c)
    for seq in range(b):
        assert cache.reserve(seq, p + c)
    with torch.inference_mode():
        model.forward_pass(prompt.flatten(), [Segment(seq, 0, p, False) for seq in range(b)], cache)
    return cache


def decoder_pass(model, canvas: torch.Tensor, cache, start: int, soft: torch.Tensor | None = None) -> torch.Tensor:
    """One denoising step's model pass: each row's canvas [B, C] as a canvas segment after its `start` prefix
    positions -> final-normed hidden states [B, C, H]. Repeatable: it rewrites the same cache slots each time."""
    from dgcli.model.attention import Segment

    b, c = canvas.shape
    return model.forward_pass(canvas.flatten(), [Segment(seq, start, c, True) for seq in range(b)], cache, soft)


# ---- components ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def components(model, prompt: torch.Tensor, compiled: bool) -> dict:
    """Median times (ms, 7 reps) of the parts of a step, side by side: the decoder pass (compiled with
    --compile: its layers' row-wise work, as `dgemma --compile` runs it), the vocabulary pass with eager and
    (with --compile) compiled tile math, and the routed experts of one layer (padded batched GEMMs vs
    segments; a packed model: its packed experts)."""
    from dgcli.kernels.dispatch import vocab_pass
    from dgcli.kernels.moe_cpu import experts_grouped, experts_segments

    cfg, c, p = model.config, model.config.canvas_length, prompt.shape[1]
    cache = prompt_cache(model, prompt)
    canvas = torch.randint(0, cfg.vocab_size, (1, c), generator=torch.Generator().manual_seed(1))
    soft = torch.randn(1, c, cfg.hidden_size).to(model.embed_weight.dtype)
    name = "decode_compiled_ms" if compiled else "decode_eager_ms"
    out = {name: median(timed(lambda: decoder_pass(model, canvas, cache, p, soft), reps=7)) * 1e3}
    hidden = decoder_pass(model, canvas, cache, p, soft)
    for tiles in (False, True) if compiled else (False,):
        fn = lambda: vocab_pass(hidden, model.embed_weight, softcap=cfg.final_logit_softcapping,  # noqa: E731
                                temperature=torch.tensor(0.6), embed_scale=model.embed_scale,
                                uniform=torch.rand(1, c, dtype=torch.float64), compile_tiles=tiles)
        out[f"vocab_pass_{'compiled' if tiles else 'eager'}_tiles_ms"] = median(timed(fn, reps=7)) * 1e3
    experts = model.layers[0].experts
    x = hidden[0]
    w, idx = torch.softmax(torch.randn(c, cfg.num_experts, generator=torch.Generator().manual_seed(2)), -1).topk(
        cfg.top_k_experts, -1)
    if not hasattr(experts, "gate_up_proj"):  # prepacked (an eager CPU session's model): its stored weights are gone
        out["experts_packed_ms"] = median(timed(lambda: experts(x, w, idx), reps=7)) * 1e3
        return out
    for name, fn in (("grouped", experts_grouped), ("segments", experts_segments)):
        out[f"experts_{name}_ms"] = median(timed(lambda: fn(x, w, idx, experts.gate_up_proj, experts.down_proj),
                                                 reps=7)) * 1e3
    return out


# ---- dgemma -----------------------------------------------------------------------------------------------


def run_dgemma(model, prompt: torch.Tensor, steps: int, blocks: int) -> dict:
    from dgcli.engine import generate_events
    from dgcli.sampling.params import DiffusionEbParams
    from dgcli.sampling.events import Done, Step

    params = DiffusionEbParams(max_denoising_steps=steps, confidence_threshold=0.0, seed=0)
    t = time.perf_counter()
    step_s, done = [], None
    for ev in generate_events(model, prompt, params=params, num_blocks=blocks):
        if isinstance(ev, Step):
            step_s.append(ev.elapsed_s)
        elif isinstance(ev, Done):
            done = ev
    total = time.perf_counter() - t
    return {"total_s": total, "step_s": step_s, "steps": len(step_s), "timings": done.timings}


# ---- transformers -----------------------------------------------------------------------------------------


class _StepClock:
    """A streamer whose put_draft (called once per denoising step) records the time."""

    def __init__(self):
        self.marks = []

    def put(self, value):
        self.marks.append(("put", time.perf_counter()))

    def put_draft(self, value=None, logits=None):
        self.marks.append(("draft", time.perf_counter()))

    def end(self):
        self.marks.append(("end", time.perf_counter()))


def run_hf(path: Path, prompt: torch.Tensor, steps: int, blocks: int) -> dict:
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.bfloat16).eval()
    clock = _StepClock()
    t = time.perf_counter()
    extra = {"eos_token_id": [-1]} if blocks > 1 else {}  # no early stop on a random EOS between blocks
    with torch.inference_mode():
        model.generate(input_ids=prompt, max_new_tokens=CANVAS * blocks, max_denoising_steps=steps,
                       confidence_threshold=1e-30, streamer=clock, **extra)
    total = time.perf_counter() - t
    drafts = [m for kind, m in clock.marks if kind == "draft"]
    step_s = [b - a for a, b in zip(drafts, drafts[1:])]  # between consecutive steps (draft copy included)
    return {"total_s": total, "step_s": step_s, "steps": len(drafts)}


# ---- vocabulary-pass memory (fresh processes) ---------------------------------------------------------------

MEM_CHILD = r"""
import json, sys, torch
impl, v, h, c = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
g = torch.Generator().manual_seed(0)
E = torch.empty(v, h, dtype=torch.bfloat16)  # filled in small pieces: no large temporary before the call
for i in range(0, v, 256):
    E[i:i + 256] = torch.randn(min(256, v - i), h, generator=g).mul_(0.02)
hidden = torch.randn(1, c, h, generator=g).bfloat16()
if impl == "cpu":
    from dgcli.kernels.vocab_pass_cpu import vocab_pass_tiled as fn
else:
    from dgcli.kernels.reference import vocab_pass as fn
kw = dict(softcap=30.0, temperature=torch.tensor(0.6), embed_scale=torch.tensor(53.0).bfloat16())
fn(hidden[:, :4], E[:4096], uniform=torch.rand(1, 4, dtype=torch.float64), **kw)  # load libraries and thread pools
kw["uniform"] = torch.rand(1, hidden.shape[1], dtype=torch.float64)
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (VmHWM)
before = status("VmRSS:")
out = fn(hidden, E, **kw)
peak = status("VmHWM:")
print(json.dumps({"impl": impl, "before": before, "peak": peak, "extra": peak - before}))
"""


def vocab_memory(impl: str, v: int = 262144, h: int = 2816, c: int = CANVAS) -> dict:
    r = subprocess.run([sys.executable, "-c", MEM_CHILD, impl, str(v), str(h), str(c)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- main -----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--dir", default="/tmp/dgemma-bench-200m")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--compile", action="store_true", help="torch.compile dgemma's decoder pass (dgemma --compile)")
    ap.add_argument("--reference-too", action="store_true", help="also time dgemma with DGEMMA_KERNELS=reference")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = Path(args.dir)
    model, n_params = bench_model(path, pack=not args.compile)  # as a session runs it
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    load0 = load_avg()
    rate = matmul_rate()
    if args.compile:
        from dgcli.runtime.session import compile_decoder

        compile_decoder(model)

    # FLOPs per step averaged over a block: no soft input on the first step, no soft output on the last.
    fl = [step_flops(cfg, PROMPT_LEN, i > 0, i < args.steps - 1) for i in range(args.steps)]
    flops_step = sum(fl) / len(fl)
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load avg {load0}")
    print(f"model: {n_params / 1e6:.1f} M params, V={cfg.vocab_size}, H={cfg.hidden_size}, C={cfg.canvas_length}, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-{cfg.top_k_experts}, bf16; "
          f"prompt {PROMPT_LEN}, {args.blocks} block(s) x {args.steps} steps (fixed work)")
    print(f"work: {flops_step / 1e9:.1f} GFLOP per denoising step (matmuls)")
    print(f"bf16 matmul rate (this run): {rate['best_flops'] / 1e9:.0f} GFLOP/s "
          + ", ".join(f"{r['shape']}: {r['gflops']:.0f}" for r in rate["shapes"]))
    print(f"dgemma decoder: {'torch.compile (compile time excluded: warm-up)' if args.compile else 'eager'}")

    run_dgemma(model, prompt, 2, 1)  # warm-up: first-call costs (thread pools, GEMM plans)
    ours = run_dgemma(model, prompt, args.steps, args.blocks)
    step = median(ours["step_s"])
    result = {
        "date": datetime.date.today().isoformat(), "machine": cpu_name(), "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "params_m": n_params / 1e6,
        "matmul_gflops": rate["best_flops"] / 1e9, "step_gflop": flops_step / 1e9,
        "dgemma_step_ms": step * 1e3, "dgemma_generate_s": ours["total_s"], "dgemma_steps": ours["steps"],
        "dgemma_step_share_of_matmul_rate": flops_step / step / rate["best_flops"], "compiled": args.compile,
    }
    result["components"] = components(model, prompt, args.compile)
    if args.reference_too:  # the references on the weights as loaded (a reference session does not pack)
        os.environ["DGEMMA_KERNELS"] = "reference"
        ref = run_dgemma(bench_model(path)[0], prompt, args.steps, args.blocks)
        os.environ.pop("DGEMMA_KERNELS")
        result.update(reference_step_ms=median(ref["step_s"]) * 1e3, reference_generate_s=ref["total_s"])
    if not args.skip_hf:
        hf = run_hf(path, prompt, args.steps, args.blocks)
        result.update(hf_step_ms=median(hf["step_s"]) * 1e3 if hf["step_s"] else None,
                      hf_generate_s=hf["total_s"], hf_steps=hf["steps"],
                      speedup_generate=hf["total_s"] / ours["total_s"])
    if not args.skip_memory:
        for impl in ("cpu", "reference"):
            result[f"vocab_extra_mib_{impl}"] = vocab_memory(impl)["extra"] / 2**20
    result["load_avg"] = f"{load0} -> {load_avg()}"

    print()
    print("| figure | value |\n|---|---|")
    print(f"| dgemma denoising step (median) | {result['dgemma_step_ms']:.0f} ms |")
    print(f"| dgemma step FLOP/s / bf16 matmul rate | {flops_step / step / 1e9:.0f} / {result['matmul_gflops']:.0f} "
          f"GFLOP/s = **{100 * result['dgemma_step_share_of_matmul_rate']:.0f} %** |")
    print(f"| dgemma generate ({ours['steps']} steps) | {ours['total_s']:.2f} s |")
    if "reference_step_ms" in result:
        print(f"| dgemma, DGEMMA_KERNELS=reference: step / generate | {result['reference_step_ms']:.0f} ms / "
              f"{result['reference_generate_s']:.2f} s |")
    if "hf_generate_s" in result:
        hs = result["hf_step_ms"]
        print(f"| transformers generate ({result['hf_steps']} steps) | {result['hf_generate_s']:.2f} s"
              f" (step {hs:.0f} ms) |" if hs else f"| transformers generate | {result['hf_generate_s']:.2f} s |")
        print(f"| speed-up, generate end to end | **{result['speedup_generate']:.1f}x** |")
    for impl in ("cpu", "reference"):
        if f"vocab_extra_mib_{impl}" in result:
            print(f"| vocab pass extra peak memory, V=262144 H=2816 C=256, {impl} | "
                  f"{result[f'vocab_extra_mib_{impl}']:.1f} MiB |")
    for k, v in result["components"].items():
        print(f"| component: {k.removesuffix('_ms').replace('_', ' ')} | {v:.1f} ms |")
    print(f"| load average (start -> end) | {result['load_avg']} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
