"""`dgemma quantize SRC DST --fp8`: write an FP8-dynamic (compressed-tensors) checkpoint from a bf16 or fp32
one, which `dgemma` (and vLLM) then load at one byte per weight; `dgemma quantize SRC DST.gguf --type T`: write
one GGUF file in llama.cpp's DiffusionGemma layout (F32, BF16, Q8_0 or llama.cpp's Q4_K_M mix).

Owns: the command's flags and its summary line (stdout: the new checkpoint's path and sizes; progress on
stderr). Must not: quantize (dgcli.checkpoint.quantize does) or load the model.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from dgcli.errors import UserError

EXAMPLES = ["dgemma quantize ~/diffusiongemma-26B-A4B-it ~/diffusiongemma-26B-A4B-it-FP8 --fp8",
            "dgemma quantize dgcli/data/tiny /tmp/tiny-fp8 --fp8 && dgemma generate -m /tmp/tiny-fp8 \"Sort: 7 2 9 2\"",
            "dgemma quantize ~/diffusiongemma-26B-A4B-it ~/diffusiongemma-Q4_K_M.gguf --type q4_k_m",
            "dgemma quantize dgcli/data/tiny /tmp/tiny-q8_0.gguf --type q8_0 && dgemma generate -m /tmp/tiny-q8_0.gguf \"Sort: 7 2 9 2\""]


def quantize(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Unquantized checkpoint directory (bf16 or fp32).")],
    dst: Annotated[str, typer.Argument(metavar="DST", help="New directory for the FP8 checkpoint (absent or empty), or new .gguf file for --type.")],
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8-dynamic: e4m3 attention, MLP and expert weights with one scale per output channel, experts stored per expert.")] = False,
    nvfp4: Annotated[bool, typer.Option("--nvfp4", help="NVFP4 (compressed-tensors nvfp4-pack-quantized, NVFP4A16): the same matrices as --fp8 in e2m1 groups of 16 with e4m3 scales and one global scale each; 4 bits a weight.")] = False,
    gguf_type: Annotated[Optional[str], typer.Option("--type", metavar="TYPE", help="GGUF file: f32 | bf16 | q8_0 | q4_k_m (llama.cpp's mix: Q4_K, Q6_K for the embedding and some attn_v / ffn_down; norms and the router F32) | nvfp4 (type 40; the embedding Q8_0).")] = None,
) -> None:
    """Write an FP8-dynamic checkpoint, or a GGUF file, from a bf16 or fp32 one.

    --fp8: attention projections, the dense MLP and the experts become float8_e4m3fn with per-output-channel
    absmax scales (compressed-tensors' FP8_DYNAMIC layout, experts unfused per expert); the embedding,
    norms, router, self-conditioning MLP and vision tower are copied, as are the tokenizer and templates.
    --type: one GGUF file (llama.cpp's diffusion-gemma layout) with the config, sampler defaults, tokenizer
    and chat template in its metadata; `dgemma ... -m DST.gguf` runs it.
    """
    if fp8 + nvfp4 + (gguf_type is not None) > 1:
        raise UserError("give one format: --fp8 or --nvfp4 (a checkpoint directory) or --type TYPE (a GGUF file)")

    def progress(msg: str) -> None:
        print(f"dgemma: {msg}", file=sys.stderr)

    gb = 1e9
    if gguf_type is not None:
        kind = gguf_type.lower()  # checkpoint_to_gguf refuses a type it does not write
        if not dst.lower().endswith(".gguf"):
            raise UserError(f"{dst}: a GGUF file name ends in .gguf; name the new file DST.gguf")
        from dgcli.cli.console import check_writable
        from dgcli.checkpoint.quantize import checkpoint_to_gguf

        check_writable("DST", dst)  # before quantizing: an unwritable place must not cost the work
        s = checkpoint_to_gguf(src, dst, kind, progress=progress)
        if s.get("fallbacks"):  # the bundled model's rows of 160 hold no Q4_K block of 256: say what it got instead
            fell = sorted(s["fallbacks"].items())
            rows = sorted({k for _, ks in fell for k in ks})
            progress(f"note: {sum(len(ks) for _, ks in fell)} tensor(s) fell back from the asked type ("
                     + ", ".join(f"{len(ks)} {a} -> {b}" for (a, b), ks in fell)
                     + f"): their rows of {', '.join(map(str, rows))} values are not multiples of its block (256 "
                     "for K-quants, 64 for NVFP4); llama.cpp falls back the same way")
        types = ", ".join(f"{n} {t}" for t, n in sorted(s["by_type"].items()))
        print(f"{dst}: GGUF {kind.upper()}, {s['bytes_out'] / gb:.3g} GB (from {s['bytes_in'] / gb:.3g} GB); "
              f"tensors: {types}")
        return
    if not (fp8 or nvfp4):
        raise UserError("give the format: --fp8 (an FP8-dynamic checkpoint), --nvfp4 or --type f32|bf16|q8_0|q4_k_m (a GGUF file)")
    if dst.lower().endswith(".gguf"):
        raise UserError(f"{dst}: --fp8 / --nvfp4 write a checkpoint directory, not a GGUF file; name a directory, or use "
                        "--type q8_0|q4_k_m for a .gguf")
    from dgcli.checkpoint.quantize import quantize_checkpoint

    _check_folder(dst)
    s = quantize_checkpoint(src, dst, progress=progress, nvfp4=nvfp4)
    print(f"{dst}: {'NVFP4A16 checkpoint' if nvfp4 else 'FP8-dynamic checkpoint'}, {s['quantized_tensors']} tensors "
          f"in {'e2m1 (4 bits)' if nvfp4 else 'float8_e4m3fn'}, "
          f"{s['bytes_out'] / gb:.3g} GB of weights (from {s['bytes_in'] / gb:.3g} GB) in {s['files']} file(s)")


def _check_folder(dst: str) -> None:
    """Before quantizing: the new checkpoint's folder (or the nearest folder above it that exists) takes files."""
    import tempfile
    from pathlib import Path

    place = Path(dst).resolve()
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise UserError(f"DST {dst}: {place} is a file, not a folder; name a new folder")
    try:
        tempfile.TemporaryFile(dir=place).close()
    except OSError as e:
        raise UserError(f"DST {dst}: cannot write in {place} ({e.strerror}); pick another place") from None
