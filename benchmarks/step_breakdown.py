"""Where a denoising step's time goes, two ways.

1. Per component (the default; also `bench_kernels.py --step SPEC`): one step of `--dummy SPEC` cut to --layers,
per batch, as the engine runs it (a prompt in the paged cache, the canvas's `forward_pass`, then
`rules.sample_step`), timed by forward hooks on the model's modules (outermost hooked call only) and wrappers
around `attend` and the vocabulary pass; FLOPs per component (matmuls only, 2 per multiply-add, routed experts at
top-k) against the device's peak.
2. `--profile`: whole engine steps (fixed work, 2 blocks a request, warmed until every request took 3 steps) timed
over --steps (synchronized at both ends), then profiled over as many with torch.profiler: wall time per step
against the GPU's busy time, launches per step and the top kernels (on a CPU the top CPU ops). A step whose GPU
time is far below its wall time is bound by the host (Python and launches): what CUDA graphs (--graphs off,on)
remove. Part of benchmarks/gpu_suite.py (step `profile`).

Owns: the components, the hooks, `component_flops`, `step_breakdown` and `step_table`. Must not: change the
model; time while another benchmark runs. Timers, peaks and the JSON lines are benchmarks/harness.py's.

    python benchmarks/step_breakdown.py [--dummy 26B-A4B] [--layers 2] [--batch 1,4,8] [--prompt 128] [--reps 5]
    python benchmarks/step_breakdown.py --profile [--dummy 26B-A4B] [--layers N] [--batch 1,8] [--steps 6]
        [--graphs off,on]
"""

from __future__ import annotations

from collections import defaultdict

import torch

from harness import DUMMY_MEDIUM, TINY, Spans, device_peaks, emit, fail, parser, pct, timed

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
    # Projections fused at load (CUDA: model/gemma.py::fuse_projections) run no Linear module: their callers are timed
    fused = [(m, "project" if isinstance(m, gemma.Attention) else "condition",
              "attention" if isinstance(m, gemma.Attention) else "selfcond_mlp") for m in model.modules()
             if m.__dict__.get("fused") is not None and isinstance(m, (gemma.Attention, gemma.SelfConditioning))]
    for owner, attr, comp in ((gemma, "attend", "attention"), (rules, "vocab_pass", "vocab_pass"), *fused):
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
            if isinstance(owner, torch.nn.Module):  # an instance's wrapper: the class's method shows again
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)
    return undo


def component_flops(cfg, prefix: int) -> dict:
    """Matmul FLOPs per component of one middle step (soft embedding in and out) over one canvas after `prefix`."""
    c, h = cfg.canvas_length, cfg.hidden_size
    f = dict.fromkeys(COMPONENTS, 0.0)
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


def _component(fl: float, sec: float, inst: float, pf) -> dict:
    return dict(ms=sec * 1e3, share=sec / inst if inst else 0.0, gflop=fl / 1e9,
                tflops=fl / sec / 1e12 if fl and sec else None, flop_share=fl / sec / pf if fl and sec and pf else None)


def step_breakdown(dev, spec: str, layers: int, batches: list[int], reps: int, prompt_len: int, pf) -> list[dict]:
    """Per batch: the whole step's median time (uninstrumented), and per component its median time, share of
    the instrumented step and achieved FLOP/s."""
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
                 for k in COMPONENTS}  # norms and the rest: no matmuls
        step_flops = sum(flops.values())
        out.append(dict(model=name, batch=b, prompt_len=prompt_len, step_ms=total * 1e3, instrumented_ms=inst * 1e3,
                        step_tflops=step_flops / total / 1e12, step_flop_share=step_flops / total / pf if pf else None,
                        components=comps))
    return out


def step_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = [f"Step breakdown: {rows[0]['model']}, prompt {rows[0]['prompt_len']}, a middle step (soft embedding "
           "in and out), eager (graphs on and off: step_breakdown.py --profile). Components: ms · share of "
           "the instrumented step (its timers' own cost lands in `rest`) · achieved TFLOP/s (% of peak).", "",
           "| batch | step ms | instrumented ms | step TFLOP/s (% peak) | " + " | ".join(COMPONENTS) + " |",
           "|---|---|---|---|" + "---|" * len(COMPONENTS)]
    for r in rows:
        cells = []
        for k in COMPONENTS:
            cm = r["components"][k]
            cells.append(f"{cm['ms']:.2f} ms · {100 * cm['share']:.0f} %"
                         + (f" · {cm['tflops']:.3g} TF/s ({pct(cm['flop_share'])} %)" if cm["tflops"] else ""))
        out.append(f"| {r['batch']} | {r['step_ms']:.2f} | {r['instrumented_ms']:.2f} | {r['step_tflops']:.3g} ({pct(r['step_flop_share'])} %) | "
                   + " | ".join(cells) + " |")
    return out


# ---- --profile: whole engine steps under torch.profiler --------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_batch(model, batch: int, prompt: int, steps: int, graphs: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from dgcli.engine import LLMEngine as Engine, Request
    from dgcli.sampling.events import Step
    from dgcli.sampling.params import DiffusionEbParams

    device = model.embed_weight.device
    params = DiffusionEbParams(max_denoising_steps=64, confidence_threshold=0.0)
    engine = Engine(model, slots=batch, max_len=prompt + 2 * model.config.canvas_length, pad_id=0, graphs=graphs)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(3, model.config.vocab_size, (prompt,), generator=g)
        engine.submit(Request(id=i, prompt=ids, params=params, num_blocks=2, seed=i))
    seen = 0
    while seen < 3 * batch:  # prompts encoded and every canvas 3 steps in: the steady state
        seen += sum(isinstance(e, Step) for e in engine.step())
    wall = timed(lambda: [list(engine.step()) for _ in range(steps)], device, reps=1, warmup=0) / steps * 1e3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            list(engine.step())
        _sync(device)
    gpu = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
    busy = sum(e.duration_ns() for e in gpu) / 1e6 / steps
    by_name: dict[str, float] = {}
    for e in gpu:
        by_name[e.name()] = by_name.get(e.name(), 0.0) + e.duration_ns() / 1e6 / steps
    if not gpu:  # CPU: the top ops by their own time
        by_name = {k.key: k.self_cpu_time_total / 1e3 / steps for k in prof.key_averages()}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"batch": batch, "graphs": graphs, "wall_ms_per_step": round(wall, 2), "gpu_busy_ms_per_step": round(busy, 2) if gpu else None,
            "gpu_busy_share": round(busy / wall, 3) if gpu else None, "launches_per_step": round(len(gpu) / steps, 1),
            "top_ms_per_step": [(name[:70], round(ms, 3)) for name, ms in top]}


def profile_table(rows: list[dict]) -> list[str]:
    out = ["| batch | graphs | wall ms/step | GPU busy ms/step | busy share | launches/step |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['batch']} | {'on' if r['graphs'] else 'off'} | {r['wall_ms_per_step']} | "
                   f"{r['gpu_busy_ms_per_step']} | {r['gpu_busy_share']} | {r['launches_per_step']} |")
    return out


def profile_main(args, dev) -> None:
    from dgcli.checkpoint.random_weights import dummy_config, random_model

    raw, _, name = dummy_config(args.dummy, args.layers)
    model = random_model(raw, dtype=torch.bfloat16, device=dev)
    print(f"model: {name}; device: {dev}{' (' + torch.cuda.get_device_name() + ')' if dev.type == 'cuda' else ''}")
    rows = []
    with torch.inference_mode():
        for b in (int(x) for x in args.batch.split(",")):
            for mode in args.graphs.split(","):
                rows.append(profile_batch(model, b, args.prompt, args.steps, graphs=mode.strip() == "on"))
                emit(rows[-1])
    print("\n".join(["", *profile_table(rows)]))


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dummy", "--spec", dest="dummy", default=None,
                    help="a config.json or the word 26B-A4B (default: 26B-A4B on CUDA, dummy-medium on CPU)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: 2 per component)")
    ap.add_argument("--batch", default=None, help="batch sizes (default: 1,4,8 per component, 1,8 with --profile)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="whole engine steps under torch.profiler instead")
    ap.add_argument("--steps", type=int, default=6, help="--profile: engine steps timed, then profiled")
    ap.add_argument("--graphs", default="off", help="--profile: off, on, or off,on (the engine without / with "
                    "CUDA graphs)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        fail("step_breakdown", "no CUDA device here; run with --device cpu")
    args.dummy = args.dummy or ("26B-A4B" if dev.type == "cuda" else str(DUMMY_MEDIUM))
    args.batch = args.batch or ("1,8" if args.profile else "1,4,8")
    if args.dry_run:
        args.dummy, args.layers, args.batch, args.prompt, args.reps, args.steps = str(TINY), 2, "1", 16, 1, 1
    from dgcli.errors import UserError
    from dgcli.checkpoint.random_weights import dummy_config

    try:
        batches = [int(b) for b in args.batch.split(",")]
        dummy_config(args.dummy, args.layers)
    except ValueError:
        fail("step_breakdown", f"--batch {args.batch!r}: give batch sizes like 1,4,8")
    except UserError as e:  # a bad --dummy config or --layers
        fail("step_breakdown", str(e))
    if args.profile or args.dry_run:
        profile_main(args, dev)
        if args.profile:
            return
    spec, args.layers = args.dummy, args.layers or 2
    pf = None if args.dry_run else device_peaks(dev)[1]
    rows = step_breakdown(dev, spec, args.layers, batches, args.reps, args.prompt, pf)
    print("\n".join(step_table(rows)))
    emit({"step": rows})


if __name__ == "__main__":
    main()
