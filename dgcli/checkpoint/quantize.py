"""`dgemma quantize`'s writers, tensor by tensor (the model is never built: a 52 GB checkpoint needs about one shard
of memory). `quantize_checkpoint` (--fp8 / --nvfp4) writes what llm-compressor's FP8_DYNAMIC (NVFP4A16) recipe
writes: the attention projections and dense MLP quantized (`fp8.quantize_rows` / `nvfp4.quantize_rows`), the fused
experts unfused into per-expert linears quantized likewise, everything else copied; one output shard per source
shard, config.json with its `quantization_config`, every other file copied. `checkpoint_to_gguf` (--type) writes
one GGUF file in llama.cpp's DiffusionGemma layout and type mix. Must not: run the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from dgcli.checkpoint import compressed_tensors as ct
from dgcli.checkpoint import ggml_quants
from dgcli.checkpoint.config import read_json
from dgcli.checkpoint.directory import _open, checkpoint_files, to_module_name
from dgcli.checkpoint.load import GGUF, format_of, load_config
from dgcli.checkpoint.nvfp4 import GGUF_TYPE as NVFP4
from dgcli.checkpoint.vision import VISION
from dgcli.errors import UserError
from dgcli.model import fp8
from dgcli.model import nvfp4 as model_nvfp4

FUSED = re.compile(r"^(layers\.\d+\.experts)\.(gate_up_proj|down_proj)$")
WEIGHT_FILES = ("model.safetensors.index.json",)


def _linear(prefix: str, w: torch.Tensor, nvfp4: bool) -> dict[str, torch.Tensor]:
    """One quantized linear's tensors (checkpoint names under `prefix`): FP8 `weight` + `weight_scale`, or
    compressed-tensors NVFP4 `weight_packed` + `weight_scale` + `weight_global_scale` (its own global)."""
    if nvfp4:
        packed, s, g = model_nvfp4.quantize_rows(w)
        return {f"{prefix}.weight_packed": packed, f"{prefix}.weight_scale": s, f"{prefix}.weight_global_scale": g[:1]}
    q, s = fp8.quantize_rows(w)
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": s}


def _quantized(key: str, t: torch.Tensor, nvfp4: bool = False) -> dict[str, torch.Tensor]:
    """One source tensor -> its output tensors (checkpoint names)."""
    name = to_module_name(key)
    if name.endswith(".weight") and fp8.QUANTIZED.match(name.removesuffix(".weight")):
        return _linear(key.removesuffix(".weight"), t, nvfp4)
    m = FUSED.match(name)
    if m is None:
        return {key: t}
    prefix = key[: -len(m.group(2))]  # "model.decoder.layers.L.experts."
    out = {}
    for sub, w in ct.per_expert(t, m.group(2)):  # clones: safetensors refuses tensors sharing storage
        out.update({k: v.clone() for k, v in _linear(prefix + sub, w, nvfp4).items()})
    return out


def _source(src: Path, verb: str):
    """SRC's config: an unquantized checkpoint directory (not a GGUF file, which the run commands read)."""
    if format_of(src, file_ok=False) == GGUF:
        raise UserError(f"{src} is a GGUF file; dgemma quantize converts a checkpoint directory (config.json, "
                        "model*.safetensors and tokenizer.json)")
    cfg = load_config(src, file_ok=False)
    if cfg.quantization is not None:
        raise UserError(f"{src}: already quantized ({cfg.quantization.scheme}); {verb} an unquantized checkpoint")
    return cfg


def _as_new_file(path: Path) -> None:
    """The mode open() gives (0666 less the umask): safetensors writes a 0600 temporary file and renames it."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def quantize_checkpoint(src: str | Path, dst: str | Path, *, progress: Callable[[str], None] | None = None,
                        nvfp4: bool = False) -> dict:
    """Write the FP8-dynamic (or `nvfp4`: NVFP4A16) twin of checkpoint `src` into `dst` (absent or empty). Returns a
    summary: tensors quantized, bytes read and written."""
    src, dst = Path(src), Path(dst)
    cfg = _source(src, "quantize")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"{dst}: exists and is not empty; pick a new directory (or remove it)")
    if dst.resolve() == src.resolve():
        raise UserError(f"{dst}: is the source checkpoint; pick a new directory")
    files = checkpoint_files(src)
    shards = sorted(set(files.values()))
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    summary = {"quantized_tensors": 0, "bytes_in": 0, "bytes_out": 0, "files": len(shards)}
    for n, f in enumerate(shards, 1):
        if progress:
            progress(f"quantizing {f.name} ({n}/{len(shards)})")
        out: dict[str, torch.Tensor] = {}
        with _open(f) as st:
            for key in st.keys():
                t = st.get_tensor(key)
                if not t.is_floating_point():
                    raise UserError(f"{f.name}: tensor {key!r} has dtype {t.dtype}; expected a floating-point tensor")
                if t.dtype == fp8.FP8:
                    raise UserError(f"{f.name}: tensor {key!r} is already float8; quantize an unquantized checkpoint")
                summary["bytes_in"] += t.numel() * t.element_size()
                parts = _quantized(key, t, nvfp4)
                summary["quantized_tensors"] += sum(k.endswith((".weight", ".weight_packed")) and v.dtype in (
                    fp8.FP8, torch.uint8) for k, v in parts.items())
                out.update(parts)
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        _as_new_file(dst / f.name)
        summary["bytes_out"] += sum(v.numel() * v.element_size() for v in out.values())
        weight_map.update({k: f.name for k in out})
        del out
    if (src / "model.safetensors.index.json").exists():
        index = {"metadata": {"total_size": summary["bytes_out"]}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    raw = read_json(src / "config.json")
    vision = any(k.startswith(VISION) for k in files)
    raw["quantization_config"] = ct.quantization_config(cfg.num_hidden_layers, vision=vision or "vision_config" in raw,
                                                        nvfp4=nvfp4)
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True))
    for p in sorted(src.rglob("*")):  # tokenizer, templates, generation/processor configs, diffusers files
        rel = p.relative_to(src)
        if (p.is_dir() or rel.parts[0].startswith(".") or p.suffix == ".safetensors"
                or str(rel) in WEIGHT_FILES + ("config.json",)):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dst / rel)
    return summary


# ---- GGUF (`dgemma quantize SRC DST.gguf --type ...`) ------------------------------------------------------

GGUF_KINDS = {"f32": 0, "bf16": 32, "q8_0": 7, "q4_k_m": 15, "nvfp4": 39}  # --type -> llama.cpp's general.file_type


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_types(kind: str, shapes: dict[str, tuple[int, ...]], n_layers: int,
               fallbacks: dict | None = None) -> dict[str, int]:
    """The ggml type of each GGUF tensor (name -> logical shape) for `--type kind`, as llama.cpp picks them: 1-D
    tensors and the router (`ffn_gate_inp`) stay F32; q8_0 makes every other matrix Q8_0; q4_k_m is Q4_K with Q6_K
    for the embedding (the tied head) and for `attn_v` and `ffn_down(_exps)` in the "more bits" layers; nvfp4 makes
    the matrices but the embedding NVFP4 where rows are multiples of 64 (else Q8_0). Other row lengths fall back as
    llama.cpp does (`ggml_quants.type_for`; else F16), collected in `fallbacks`: (asked, given) -> rows."""
    from dgcli.model import ggml

    v_names = sorted((n for n in shapes if n.endswith(".attn_v.weight")), key=lambda n: int(n.split(".")[1]))
    out = {}
    for name, shape in shapes.items():
        if kind == "f32" or len(shape) < 2 or ".ffn_gate_inp." in name:
            out[name] = ggml.F32
            continue
        if kind == "bf16":
            out[name] = ggml.BF16
            continue
        t = ggml.Q8_0
        if kind == "nvfp4" and name != "token_embd.weight":  # type 40 (blocks of 64; else Q8_0); the tied head Q8_0
            t = NVFP4
        if kind == "q4_k_m":
            t = ggml.Q4_K
            layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
            if name == "token_embd.weight":
                t = ggml.Q6_K
            elif name.endswith(".attn_v.weight") and _more_bits(v_names.index(name), len(v_names)):
                t = ggml.Q6_K
            elif (".ffn_down." in name or ".ffn_down_exps." in name) and _more_bits(layer, n_layers):
                t = ggml.Q6_K
        if t == NVFP4:  # blocks of 64 (both halves of a layer's experts, or neither), else Q8_0
            other = shape[-2] // (2 if "gate_up" in name else 1) if "_exps." in name else 0
            fits = shape[-1] % 64 == 0 and other % 64 == 0
            out[name] = NVFP4 if fits else ggml_quants.type_for(ggml.Q8_0, shape[-1]) or ggml.F16
        else:
            out[name] = ggml_quants.type_for(t, shape[-1]) or ggml.F16
        if out[name] != t and fallbacks is not None:
            fallbacks.setdefault((ggml.NAMES.get(t, "NVFP4"), ggml.NAMES[out[name]]), []).append(shape[-1])
    return out


def checkpoint_to_gguf(src: str | Path, dst: str | Path, kind: str, *,
                       progress: Callable[[str], None] | None = None) -> dict:
    """Write checkpoint `src` (unquantized) as one GGUF file `dst` in llama.cpp's DiffusionGemma layout, tensor
    by tensor (one tensor in memory at a time). Returns a summary: tensors by type, bytes read and written."""
    from dgcli.checkpoint import gguf, gguf_model
    from dgcli.checkpoint.load import load_generation_config
    from dgcli.text.gguf_vocab import vocab_metadata
    from dgcli.text.tokenizer import load_tokenizer

    src, dst = Path(src), Path(dst)
    if kind not in GGUF_KINDS:
        raise UserError(f"--type {kind}: use one of {', '.join(GGUF_KINDS)}")
    cfg = _source(src, "convert")
    if dst.exists():
        raise UserError(f"{dst}: exists; pick a new file name (or remove it)")
    if not dst.parent.is_dir():
        raise UserError(f"{dst}: its folder {dst.parent} does not exist; create it first")
    # A checkpoint without tokenizer.json (random benchmark weights) makes a file bench and sweep can run.
    tok = load_tokenizer(src) if (src / "tokenizer.json").is_file() else None
    files = checkpoint_files(src)
    where: dict[str, tuple[str, Path]] = {}  # GGUF name -> (checkpoint key, file)
    shapes: dict[str, tuple[int, ...]] = {}
    for key, f in files.items():
        name = to_module_name(key)
        if key.startswith(VISION) or key == "lm_head.weight":
            continue
        try:
            gname = gguf_model.to_gguf_name(name)
        except KeyError:
            raise UserError(f"{f.name}: tensor {key!r} has no place in a DiffusionGemma GGUF file") from None
        with _open(f) as st:
            shapes[gname] = tuple(st.get_slice(key).get_shape())
        where[gname] = (key, f)
    shapes[gguf_model.ROPE_FREQS] = (cfg.global_head_dim // 2,)
    fallbacks: dict = {}
    types = gguf_types(kind, shapes, cfg.num_hidden_layers, fallbacks)
    summary: dict = {"bytes_in": 0, "by_type": {}, "fallbacks": fallbacks}

    def data(gname: str):
        if gname == gguf_model.ROPE_FREQS:
            return gguf_model.rope_freqs(cfg)
        key, f = where[gname]
        with _open(f) as st:
            t = st.get_tensor(key)
        summary["bytes_in"] += t.numel() * t.element_size()
        return ggml_quants.quantize(t.float().reshape(shapes[gname]), types[gname])

    order = sorted(shapes, key=lambda n: (n.startswith("blk."), int(n.split(".")[1]) if n.startswith("blk.") else 0, n))
    tensors = [gguf.TensorOut(n, shapes[n], types[n], lambda n=n: data(n)) for n in order]
    md = gguf_model.model_metadata(cfg, load_generation_config(src), name=src.name, file_type=GGUF_KINDS[kind])
    if tok is not None:
        md.update(vocab_metadata(tok.tokenizer, tok.chat_template))
    if progress:
        progress(f"writing {len(tensors)} tensors to {dst}")
    summary["bytes_out"] = gguf.write_gguf(dst, md, tensors, progress=progress)
    for n, t in types.items():
        summary["by_type"][gguf.type_name(t)] = summary["by_type"].get(gguf.type_name(t), 0) + 1
    return summary
