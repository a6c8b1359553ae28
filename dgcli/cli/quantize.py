"""`dgemma quantize SRC DST --fp8`: write an FP8-dynamic (compressed-tensors) checkpoint from a bf16 or fp32
one, which `dgemma` (and vLLM) then load at one byte per weight.

Owns: the command's flags and its summary line (stdout: the new checkpoint's path and sizes; progress on
stderr). Must not: quantize (dgcli.model.quantize does) or load the model.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from dgcli.errors import UserError

EXAMPLES = ["dgemma quantize ~/diffusiongemma-26B-A4B-it ~/diffusiongemma-26B-A4B-it-FP8 --fp8",
            "dgemma quantize dgcli/data/tiny /tmp/tiny-fp8 --fp8 && dgemma generate -m /tmp/tiny-fp8 \"Sort: 7 2 9 2\""]


def quantize(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Unquantized checkpoint directory (bf16 or fp32).")],
    dst: Annotated[str, typer.Argument(metavar="DST", help="New directory for the quantized checkpoint (absent or empty).")],
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8-dynamic: e4m3 attention, MLP and expert weights with one scale per output channel, experts stored per expert (the only format; required).")] = False,
) -> None:
    """Write an FP8-dynamic checkpoint from a bf16 one.

    Attention projections, the dense MLP and the experts become float8_e4m3fn with per-output-channel
    absmax scales (compressed-tensors' FP8_DYNAMIC layout, experts unfused per expert); the embedding,
    norms, router, self-conditioning MLP and vision tower are copied, as are the tokenizer and templates.
    """
    if not fp8:
        raise UserError("give the format: --fp8 (FP8-dynamic, the only one dgemma writes)")
    from dgcli.model.quantize import quantize_checkpoint

    def progress(msg: str) -> None:
        print(f"dgemma: {msg}", file=sys.stderr)

    s = quantize_checkpoint(src, dst, progress=progress)
    gb = 1e9
    print(f"{dst}: FP8-dynamic checkpoint, {s['quantized_tensors']} tensors in float8_e4m3fn, "
          f"{s['bytes_out'] / gb:.3g} GB of weights (from {s['bytes_in'] / gb:.3g} GB) in {s['files']} file(s)")
