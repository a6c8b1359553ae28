"""Command-line options declared once (Typer `Annotated` types) and reused by every command.

Owns: flag names, aliases and help texts (PRODUCT.md is the contract), and turning the sampler flags
into the `flags` dict `dgcli.runtime.settings.resolve` takes. Must not: import torch or load anything.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

Model = Annotated[Optional[str], typer.Option("--model", "-m", help="Checkpoint directory (default: the bundled tiny model).")]
Preset = Annotated[Optional[str], typer.Option("--preset", help="Preset name (presets/NAME.yaml) or YAML file.")]
Device = Annotated[Optional[str], typer.Option("--device", help="auto | cpu | cuda | cuda:N")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="auto | bfloat16 | float32")]
Seed = Annotated[Optional[int], typer.Option("--seed", "--diffusion-seed", help="Sampler seed (default 0).")]
ShowConfig = Annotated[bool, typer.Option("--show-config", help="Print the resolved settings and their sources, then exit.")]

Steps = Annotated[Optional[int], typer.Option("--diffusion-steps", "--max-denoising-steps",
                                              help="Most denoising steps per block (default 48).")]
TMin = Annotated[Optional[float], typer.Option("--t-min", help="Asymptotic temperature (default 0.4).")]
TMax = Annotated[Optional[float], typer.Option("--t-max", help="Temperature of the first step (default 0.8).")]
EntropyBound = Annotated[Optional[float], typer.Option("--entropy-bound", help="Accept rule bound in nats (default 0.1).")]
Stability = Annotated[Optional[int], typer.Option("--stability-threshold", help="Equal argmax canvases needed to stop (default 1).")]
Confidence = Annotated[Optional[float], typer.Option("--confidence-threshold",
                                                     help="Mean entropy below which a stable block stops (default 0.005; 0 = always run every step).")]
Blocks = Annotated[Optional[int], typer.Option("--blocks", "--diffusion-blocks",
                                               help="Most blocks (canvases) to generate; 0 = derive from --max-tokens (default 1).")]
MaxTokens = Annotated[Optional[int], typer.Option("--max-tokens", help="Token budget; without --blocks it sets the block count.")]

Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the decoder pass and the vocabulary tile math: faster steps after a one-off compile of tens of seconds.")]
Trace = Annotated[Optional[str], typer.Option("--trace", help="Write the per-step JSONL trace to FILE.")]
InitCanvas = Annotated[Optional[str], typer.Option("--init-canvas", help=(
    "Warm-start the first block: token ids (5,6,7) or text. Only digits, commas, minus signs and spaces, or a "
    "whole number then a comma, means ids: each must be a valid id, none empty (1,,2 and 1,2,abc are errors)."))]
Thinking = Annotated[bool, typer.Option("--thinking", help="Let the model think first (template without the empty thought channel).")]
ShowThinking = Annotated[bool, typer.Option("--show-thinking", help="Print the thought channel too.")]
Raw = Annotated[bool, typer.Option("--raw", help="Send the prompt without the chat template.")]


# bench, sweep and info: the workload and the target.
Dummy = Annotated[Optional[str], typer.Option(
    "--dummy", help="Random weights for a config.json path (or the word 26B-A4B, the shipped config): no weights read; fixed-work mode.")]
Layers = Annotated[Optional[int], typer.Option("--layers", help="Keep only the first N layers of a --dummy config (last forced to full attention).")]
Prompts = Annotated[Optional[str], typer.Option("--prompts", help="JSONL prompt file ({\"prompt\", \"answer\"?} per line; default: the bundled prompt set).")]
RandomPrompts = Annotated[bool, typer.Option("--random-prompts", help="Use random token ids as prompts (a loud warning: early stopping behaves differently).")]
NumPrompts = Annotated[Optional[int], typer.Option("--num-prompts", help="Use the first N prompts (random prompts: N, default 4).")]
InputLen = Annotated[int, typer.Option("--random-input-len", help="Length of random-id prompts.")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Never stop at a stop id: every request runs all its blocks (forced for --dummy).")]
Warmup = Annotated[int, typer.Option("--warmup", "--num-warmups", help="Untimed warm-up requests first.")]
Label = Annotated[Optional[str], typer.Option("--label", help="A name for the row(s).")]
Metadata = Annotated[Optional[list[str]], typer.Option("--metadata", help="KEY=VALUE recorded in every row's provenance (repeatable).")]
MeasurePeaks = Annotated[bool, typer.Option("--measure-peaks/--no-measure-peaks", help="Measure this CPU's matmul and bandwidth peaks (~1 s) for the roofline.")]

def sampler_flags(*, steps=None, t_min=None, t_max=None, entropy_bound=None, stability=None, confidence=None,
                  seed=None, blocks=None, device=None, dtype=None, max_tokens=None) -> dict:
    """The flags given on the command line, keyed as in presets (None = not given)."""
    if max_tokens is not None and blocks is None:
        blocks = 0  # --max-tokens alone means "as many blocks as the budget needs"
    return {"max_denoising_steps": steps, "t_min": t_min, "t_max": t_max, "entropy_bound": entropy_bound,
            "stability_threshold": stability, "confidence_threshold": confidence, "seed": seed,
            "max_blocks": blocks, "device": device, "dtype": dtype, "max_tokens": max_tokens}
