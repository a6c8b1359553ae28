"""A denoising step's time per component (bench_kernels.py --step): one step of `--dummy SPEC` cut to --layers,
per batch, as the engine runs it (bench_cpu_step.py's prompt cache and `forward_pass`, then `rules.sample_step`),
timed by forward hooks on the model's modules (outermost hooked call only) and wrappers around `attend` and the
vocabulary pass; FLOPs per component from step_components.py (matmuls only).

Owns: the components, the hooks, `step_breakdown` and `step_table`. Must not: change the model; time while
another benchmark runs. The timers and the percentage format are bench_kernels.py's.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

from bench_kernels import Spans, _pct, timed

ROOT = Path(__file__).resolve().parents[1]

# rest: whatever no timer wraps (embedding, RoPE, residual adds, layer scalars, accept / renoise / stop)
COMPONENTS = ("attention", "dense_mlp", "selfcond_mlp", "experts", "norms", "vocab_pass", "rest")


_LEAVES = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "o_proj": "attention",
           "gate_proj": "selfcond_mlp", "up_proj": "selfcond_mlp", "down_proj": "selfcond_mlp",
           "mlp": "dense_mlp", "router": "experts", "experts": "experts"}


def _component_of(name: str, mod) -> str | None:
    """The component a module's calls count to (None: not hooked; its parent's or the remainder). Linears
    count only under self_attn (projections) and self_conditioning (its MLP); the dense MLP is hooked whole."""
    comp = _LEAVES.get(name.rsplit(".", 1)[-1])
    if comp == "attention" and ".self_attn." not in name or comp == "selfcond_mlp" and not name.startswith(
            "self_conditioning."):
        return None
    return comp or ("norms" if "RMSNorm" in type(mod).__name__ else None)


def instrument(model, spans: Spans):
    """Forward hooks on the model's modules and timed wrappers around `attend` (gemma's name for it) and the
    sampler's `vocab_pass`; returns an undo()."""
    import dgcli.model.gemma as gemma
    import dgcli.sampling.rules as rules

    handles = []
    for name, mod in model.named_modules():
        comp = _component_of(name, mod)
        if comp is not None:
            handles.append(mod.register_forward_pre_hook(lambda m, a, c=comp: spans.enter(c)))
            handles.append(mod.register_forward_hook(lambda m, a, o: spans.exit()))
    patched = []
    for owner, attr, comp in ((gemma, "attend", "attention"), (rules, "vocab_pass", "vocab_pass")):
        fn = getattr(owner, attr, None)
        if fn is None:
            continue  # renamed by the model's owners: its time falls to the remainder

        def wrapped(*a, _fn=fn, _c=comp, **kw):
            spans.enter(_c)
            try:
                return _fn(*a, **kw)
            finally:
                spans.exit()
        setattr(owner, attr, wrapped)
        patched.append((owner, attr, fn))

    def undo():
        for h in handles:
            h.remove()
        for owner, attr, fn in patched:
            setattr(owner, attr, fn)
    return undo


def _component(fl: float, sec: float, inst: float, pf) -> dict:
    return dict(ms=sec * 1e3, share=sec / inst if inst else 0.0, gflop=fl / 1e9,
                tflops=fl / sec / 1e12 if fl and sec else None, flop_share=fl / sec / pf if fl and sec and pf else None)


def step_breakdown(dev, spec: str, layers: int, batches: list[int], reps: int, prompt_len: int, pf) -> list[dict]:
    """Per batch: the whole step's median time (uninstrumented), and per component its median time, share of
    the instrumented step and achieved FLOP/s."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cpu_step import decoder_pass, prompt_cache
    from step_components import component_flops

    from dgcli.checkpoint.config import parse_config
    from dgcli.checkpoint.random_weights import dummy_config, random_model
    from dgcli.sampling.params import DiffusionEbParams
    from dgcli.sampling.rules import sample_step

    raw, _, name = dummy_config(spec, layers)
    model = random_model(raw, seed=0, dtype=torch.bfloat16, device=dev)
    cfg, params = parse_config(raw), DiffusionEbParams(confidence_threshold=0.0)
    c, out = cfg.canvas_length, []
    for b in batches:
        g = torch.Generator(device=dev).manual_seed(b)
        prompt = torch.randint(0, cfg.vocab_size, (b, prompt_len), device=dev, generator=g)
        canvas = torch.randint(0, cfg.vocab_size, (b, c), device=dev, generator=g)
        noise = torch.randint(0, cfg.vocab_size, (b, c), device=dev, generator=g)
        soft = (torch.randn(b, c, cfg.hidden_size, device=dev, generator=g) * 0.5).bfloat16()
        uniform = torch.rand(b, c, dtype=torch.float64, device=dev, generator=g)
        temp, history = torch.full((b,), 0.6, device=dev), torch.full((1, b, c), -1, dtype=torch.long, device=dev)
        cache = prompt_cache(model, prompt)

        def step():
            with torch.inference_mode():
                hidden = decoder_pass(model, canvas, cache, prompt_len, soft)
                return sample_step(model, hidden, temp, history.clone(), params, uniform, noise, True)
        total = timed(step, dev, reps)
        spans, per = Spans(dev), defaultdict(list)
        undo = instrument(model, spans)
        try:
            step()  # warm the hooks
            spans.totals()
            for _ in range(reps):
                t = timed(step, dev, 1, warmup=0)
                got = spans.totals()
                got["rest"] = max(0.0, t - sum(got.values()))
                for k in COMPONENTS:
                    per[k].append(got.get(k, 0.0))
                per["instrumented"].append(t)
        finally:
            undo()
        flops = {k: v * b for k, v in component_flops(cfg, prompt_len).items()}
        med = {k: sorted(v)[len(v) // 2] for k, v in per.items()}
        inst = med.pop("instrumented")
        comps = {k: _component(flops.get(k, 0.0) if k not in ("norms", "rest") else 0.0, med[k], inst, pf)
                 for k in COMPONENTS}  # norms and the rest: no matmuls (step_components counts none)
        step_flops = sum(flops.values())
        out.append(dict(model=name, batch=b, prompt_len=prompt_len, step_ms=total * 1e3, instrumented_ms=inst * 1e3,
                        step_tflops=step_flops / total / 1e12, step_flop_share=step_flops / total / pf if pf else None,
                        components=comps))
    return out


def step_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = [f"Step breakdown: {rows[0]['model']}, prompt {rows[0]['prompt_len']}, a middle step (soft embedding "
           "in and out), eager (graphs on and off: benchmarks/step_profile.py). Components: ms · share of "
           "the instrumented step (its timers' own cost lands in `rest`) · achieved TFLOP/s (% of peak).", "",
           "| batch | step ms | instrumented ms | step TFLOP/s (% peak) | " + " | ".join(COMPONENTS) + " |",
           "|---|---|---|---|" + "---|" * len(COMPONENTS)]
    for r in rows:
        cells = []
        for k in COMPONENTS:
            cm = r["components"][k]
            cells.append(f"{cm['ms']:.2f} ms · {100 * cm['share']:.0f} %"
                         + (f" · {cm['tflops']:.3g} TF/s ({_pct(cm['flop_share'])} %)" if cm["tflops"] else ""))
        out.append(f"| {r['batch']} | {r['step_ms']:.2f} | {r['instrumented_ms']:.2f} | {r['step_tflops']:.3g} ({_pct(r['step_flop_share'])} %) | "
                   + " | ".join(cells) + " |")
    return out
