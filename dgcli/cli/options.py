"""Command-line options declared once (Typer `Annotated` types) and reused by every command.

Owns: flag names, aliases, metavars and help texts (PRODUCT.md is the contract), the one way defaults
are written (`[default: X]`, as Typer prints them), and turning the sampler flags into the `flags` dict
`dgcli.runtime.settings.resolve` takes. Must not: import torch or load anything.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer


def dflt(help: str, default: str) -> str:
    """Help for an option whose real default is resolved later (it defaults to None), written the way
    Typer writes the others, so every help page shows defaults one way."""
    return f"{help}  [default: {default}]"


# Sampler options default to None: the value comes from defaults < checkpoint < preset < flag.
CKPT = "or the checkpoint's"

Model = Annotated[Optional[str], typer.Option("--model", "-m", metavar="DIR|FILE.gguf", help=dflt("Checkpoint directory, or a llama.cpp GGUF file.", "the bundled tiny model"))]
Preset = Annotated[Optional[str], typer.Option("--preset", metavar="NAME|FILE", help="Preset name (presets/NAME.yaml) or YAML file.")]
Device = Annotated[Optional[str], typer.Option("--device", metavar="DEVICE", help=dflt("auto | cpu | cuda | cuda:N", "auto"))]
Dtype = Annotated[Optional[str], typer.Option("--dtype", metavar="DTYPE", help=dflt("auto | bfloat16 | float32", "auto"))]
Seed = Annotated[Optional[int], typer.Option("--seed", "--diffusion-seed", metavar="N", help=dflt("Sampler seed.", "0"))]
ShowConfig = Annotated[bool, typer.Option("--show-config", help="Print the resolved settings and their sources, then exit.")]

Steps = Annotated[Optional[int], typer.Option("--diffusion-steps", "--max-denoising-steps", metavar="N",
                                              help=dflt("Most denoising steps per block.", f"48, {CKPT}"))]
TMin = Annotated[Optional[float], typer.Option("--t-min", metavar="X", help=dflt("Asymptotic temperature.", f"0.4, {CKPT}"))]
TMax = Annotated[Optional[float], typer.Option("--t-max", metavar="X", help=dflt("Temperature of the first step.", f"0.8, {CKPT}"))]
EntropyBound = Annotated[Optional[float], typer.Option("--entropy-bound", metavar="X", help=dflt("Accept rule bound in nats.", f"0.1, {CKPT}"))]
Stability = Annotated[Optional[int], typer.Option("--stability-threshold", metavar="N",
                                                  help=dflt("Equal argmax canvases needed to stop.", f"1, {CKPT}"))]
Confidence = Annotated[Optional[float], typer.Option("--confidence-threshold", metavar="X", help=dflt(
    "Mean entropy below which a stable block stops; 0 = always run every step.", f"0.005, {CKPT}"))]
Blocks = Annotated[Optional[int], typer.Option("--blocks", "--diffusion-blocks", metavar="N", help=dflt(
    "Most blocks (canvases) to generate; 0 = derive from the token budget.",
    "ceil(token budget / canvas): the checkpoint's max_new_tokens or --max-tokens; 1 without a budget"))]
MaxTokens = Annotated[Optional[int], typer.Option("--max-tokens", metavar="N", help=dflt(
    "Token budget: answers are cut there; without --blocks it sets the block count.", "the checkpoint's max_new_tokens"))]
Threads = Annotated[Optional[int], typer.Option("--threads", metavar="N", help=dflt(
    "CPU threads for torch (shown in the card and provenance).",
    "OMP_NUM_THREADS if set, else 1 for a CPU model under 50 M parameters, else one per core"))]
LowMemory = Annotated[Optional[bool], typer.Option("--low-memory/--no-low-memory", help=dflt(
    "Stream a GGUF model's weights from its file layer by layer (read ahead, dropped once used): for a machine "
    "whose memory cannot hold them.", "on by itself where they do not fit the memory free (a cgroup cap or "
    "MemAvailable)"))]

BatchSize = Annotated[int, typer.Option("--batch-size", metavar="N", help=(
    "Requests denoised together (continuous batching: a finished request's slot takes the next)."))]
# bench and sweep: a comma list (one row, or one grid axis value, per size); parsed by
# dgcli.measure.grid.parse_batch_sizes in the command body, before the model, the card and the peaks.
BatchSizes = Annotated[str, typer.Option("--batch-size", metavar="N[,N...]", help=(
    "Batch sizes to measure, e.g. 1,2,4,8: every timed pass submits all prompts at once to an engine with N "
    "slots (continuous batching); one row (bench) or one grid axis value (sweep) per size."))]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the decoder pass and the vocabulary tile math: faster steps after a one-off compile of tens of seconds.")]
CudaGraphs = Annotated[Optional[bool], typer.Option("--cuda-graphs/--no-cuda-graphs", help=dflt("Replay CUDA graphs for denoising-only passes (one per batch bucket 1, 2, 4, ...; passes that encode prompts or commit blocks run eagerly). CUDA with Triton only.", "on with CUDA and Triton, unless --compile"))]
NoPrefixCaching = Annotated[bool, typer.Option("--no-prefix-caching", help=(
    "Encode every prompt whole: no sharing of cached whole blocks (16 tokens) of earlier prompts and answers "
    "between the requests of one engine (on by default; sliding layers then keep their window and one pass's rows)."))]
Trace = Annotated[Optional[str], typer.Option("--trace", metavar="FILE", help="Write the per-step JSONL trace to FILE.")]
Image = Annotated[Optional[list[str]], typer.Option("--image", metavar="FILE", help=(
    "An image in the prompt, before the text (repeatable); needs a checkpoint with a vision tower and "
    "pip install 'dgemma[vision]'."))]
InitCanvas = Annotated[Optional[str], typer.Option("--init-canvas", metavar="TEXT|ids:IDS", help=(
    "Warm-start the first block: text (\"1 2 3\" is text too), or token ids with the prefix ids: "
    "(ids:5,6,7, each a valid id). stderr says which was read."))]
Thinking = Annotated[bool, typer.Option("--thinking", help="Let the model think first (template without the empty thought channel).")]
ShowThinking = Annotated[bool, typer.Option("--show-thinking", help="Print the thought channel too (with --thinking).")]
Raw = Annotated[bool, typer.Option("--raw", help="Send the prompt without the chat template.")]


# bench, sweep and info: the workload and the target.
Dummy = Annotated[Optional[str], typer.Option(
    "--dummy", metavar="CONFIG", help="Random weights for a config.json path (or the word 26B-A4B, the shipped config): no weights read; fixed-work mode.")]
Layers = Annotated[Optional[int], typer.Option("--layers", metavar="N", help="Keep only the first N layers of a --dummy config (last forced to full attention).")]
Prompts = Annotated[Optional[str], typer.Option("--prompts", metavar="FILE", help=dflt(
    "JSONL prompt file ({\"prompt\", \"answer\"?} per line).", "the bundled prompt set"))]
RandomPrompts = Annotated[bool, typer.Option("--random-prompts", help="Use random token ids as prompts (a loud warning: early stopping behaves differently).")]
NumPrompts = Annotated[Optional[int], typer.Option("--num-prompts", metavar="N", help=dflt(
    "Use the first N prompts (random prompts: N of them).", "every prompt, or 4 random ones"))]
InputLen = Annotated[int, typer.Option("--random-input-len", metavar="N", help="Length of random-id prompts.")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Never stop at a stop id: every request runs all its blocks (forced for --dummy).")]
Warmup = Annotated[int, typer.Option("--warmup", "--num-warmups", metavar="N", help="Untimed warm-up requests first.")]
Label = Annotated[Optional[str], typer.Option("--label", metavar="NAME", help="A name for the row(s).")]
Metadata = Annotated[Optional[list[str]], typer.Option("--metadata", metavar="KEY=VALUE", help="Recorded in every row's provenance (repeatable).")]
MeasurePeaks = Annotated[bool, typer.Option("--measure-peaks/--no-measure-peaks", help="Measure this CPU's matmul and bandwidth peaks (~1 s) for the roofline.")]
PeaksFile = Annotated[Optional[str], typer.Option("--peaks", metavar="FILE", help="Use the CPU peaks pinned in FILE (written by --save-peaks, or a saved bench JSON) instead of measuring them: runs compared on a busy machine then share one floor.")]
SavePeaks = Annotated[Optional[str], typer.Option("--save-peaks", metavar="FILE", help="Write this CPU's measured peaks to FILE, for --peaks FILE in later runs.")]


# --ray (generate --input-jsonl, bench, sweep): Ray is an optional extra, imported only when --ray is given.
Ray = Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help=(
    "Spread the work over Ray actors, one session each: local (a cluster on this machine for this run), auto "
    "(RAY_ADDRESS or the head started here) or HOST:PORT. Needs pip install 'dgemma[ray]'."))]
RayWorkers = Annotated[Optional[int], typer.Option("--ray-workers", metavar="N", help=dflt(
    "With --ray: worker actors, each loading the model once.", "one per GPU of the cluster, else one per CPU"))]
RayGpus = Annotated[Optional[float], typer.Option("--ray-gpus-per-worker", metavar="G", help=dflt(
    "With --ray: GPUs each worker reserves (0 on CPU).", "1 where the cluster has GPUs, else 0"))]


def given(ctx: typer.Context, names) -> list[tuple[str, str]]:
    """(flag, parameter name) of the parameters among `names` that the command line set (typer's vendored
    click has its own ParameterSource: compared by name); an argument's flag is its name in capitals."""
    out = []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name) if p.name in names else None
        if source is not None and source.name != "DEFAULT":
            off = getattr(p, "secondary_opts", None) and ctx.params.get(p.name) is False
            out.append(((p.secondary_opts if off else p.opts)[0] if p.param_type_name == "option"
                        else p.name.upper(), p.name))
    return out


def sampler_flags(*, steps=None, t_min=None, t_max=None, entropy_bound=None, stability=None, confidence=None,
                  seed=None, blocks=None, device=None, dtype=None, max_tokens=None) -> dict:
    """The flags given on the command line, keyed as in presets (None = not given)."""
    if max_tokens is not None and blocks is None:
        blocks = 0  # --max-tokens alone means "as many blocks as the budget needs"
    return {"max_denoising_steps": steps, "t_min": t_min, "t_max": t_max, "entropy_bound": entropy_bound,
            "stability_threshold": stability, "confidence_threshold": confidence, "seed": seed,
            "max_blocks": blocks, "device": device, "dtype": dtype, "max_tokens": max_tokens}
