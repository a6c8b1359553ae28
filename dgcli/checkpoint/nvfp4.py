"""NVFP4 checkpoints: which of their modules are NVFP4 and their tensors read into model/nvfp4.py's held form, for
the two safetensors layouts and GGUF's type 40:

- compressed-tensors `nvfp4-pack-quantized` (llm-compressor; compressed_tensors/compressors/nvfp4): `<p>.weight_packed`
  uint8 [out, in/2], `<p>.weight_scale` e4m3 [out, in/16], `<p>.weight_global_scale` fp32 [1], a divisor; the W4A4
  scheme adds `<p>.input_global_scale`. Experts are unfused per expert (`experts.{i}.gate_proj`...), as in FP8.
- ModelOpt (NVIDIA TensorRT Model Optimizer's HF export, hf_quant_config.json `quant_algo: NVFP4`): `<p>.weight`
  uint8, `<p>.weight_scale` e4m3, `<p>.weight_scale_2` fp32, a multiplier (1 / global), `<p>.input_scale`.
Input scales are read past: dgemma runs both as W4A16 (activations in the model dtype). Every error names the tensor.
Must not: do math beyond checks, or decide the format (config.py / load.py do).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from dgcli.checkpoint import compressed_tensors as ct
from dgcli.errors import UserError

# role -> leaf name, per layout; the last leaf is the input scale (read past)
LEAVES = {"compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
          "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale")}


def plan(files: dict[str, Path], layout: str, to_module_name) -> tuple[dict[str, str], set[str]]:
    """(our module name -> its checkpoint prefix, for every NVFP4 module; the checkpoint keys they hold).
    A module is NVFP4 where its global-scale tensor exists (`weight_global_scale` / `weight_scale_2`)."""
    leaves = LEAVES[layout]
    modules, keys = {}, set()
    for key in files:
        if key.endswith("." + leaves[2]):
            prefix = key[: -len(leaves[2]) - 1]
            name = to_module_name(prefix + ".weight")
            if name is not None:
                modules[name.removesuffix(".weight")] = prefix
                keys |= {f"{prefix}.{leaf}" for leaf in leaves} & files.keys()
    return modules, keys


def targets(modules: dict[str, str], num_layers: int) -> tuple[set[str], set[int]]:
    """The linears and the expert layers `modules` makes NVFP4."""
    linears, experts = set(), set()
    for name in modules:
        m = ct.EXPERT_KEY.match(name + ".weight")
        if m:
            experts.add(int(m.group(1)))
        else:
            linears.add(name)
    return linears, {e for e in experts if e < num_layers}


def _get(st, f: Path, key: str, files: dict) -> torch.Tensor:
    if key not in files:
        raise UserError(f"{f.name}: checkpoint lacks tensor {key!r} (an NVFP4 module needs its weight, weight_scale "
                        "and global scale); is a shard missing?")
    return st(files[key]).get_tensor(key)


def read(modules: dict[str, str], files: dict[str, Path], layout: str, model, open_file) -> dict[str, torch.Tensor]:
    """The held tensors of every NVFP4 module (state-dict names of model/nvfp4.py's buffers), each checked against
    the module's shape; a bad tensor is one UserError naming it."""
    from dgcli.kernels import nvfp4 as k
    from dgcli.model.nvfp4 import NVFP4Experts

    leaves = LEAVES[layout]
    handles: dict[Path, object] = {}
    with contextlib.ExitStack() as opened:
        def st(f: Path):
            if f not in handles:
                handles[f] = opened.enter_context(open_file(f))
            return handles[f]

        state: dict[str, torch.Tensor] = {}
        for name, prefix in sorted(modules.items()):
            m = ct.EXPERT_KEY.match(name + ".weight")
            if m:  # one expert's gate, up or down into the fused stacks
                layer, e = int(m.group(1)), int(m.group(2))
                mod = model.layers[layer].experts if layer < len(model.layers) else None
                if not isinstance(mod, NVFP4Experts) or e >= mod.gate_up_proj.shape[0]:
                    raise UserError(f"checkpoint tensor {prefix + '.' + leaves[0]!r}: no such expert in config.json")
                target, _, rows = ct.expert_slot(name + ".weight", mod.inter)
                fused = target.rsplit(".", 1)[1]
                cols = mod.inter if fused == "down_proj" else mod.hidden
                dst = [state.setdefault(target + sfx, torch.empty_like(getattr(mod, fused + sfx), device="cpu"))[e, rows]
                       for sfx in ("", "_scale", "_global")]
            else:
                try:
                    mod = model.get_submodule(name)
                except AttributeError:
                    raise UserError(f"checkpoint tensor {prefix + '.' + leaves[0]!r}: no such module in config.json") from None
                cols = mod.in_features
                dst = [state.setdefault(f"{name}.{b}", torch.empty_like(getattr(mod, b), device="cpu"))
                       for b in ("weight_packed", "weight_scale", "weight_global")]
            f = files.get(prefix + "." + leaves[0], files[prefix + "." + leaves[2]])
            if cols % k.GROUP:
                raise UserError(f"{f.name}: tensor {prefix + '.' + leaves[0]!r}: {cols} input columns are not a multiple "
                                f"of NVFP4's group of {k.GROUP}; this checkpoint cannot be NVFP4")
            packed, scale, glob = (_get(st, f, f"{prefix}.{leaf}", files) for leaf in leaves[:3])
            rows_ = dst[0].shape[0]
            for t, want, leaf in ((packed, dst[0], leaves[0]), (scale, dst[1], leaves[1])):
                if t.dtype != want.dtype or t.shape != want.shape:
                    raise UserError(f"{f.name}: tensor {prefix + '.' + leaf!r} is {t.dtype} {list(t.shape)}; an NVFP4 "
                                    f"[{rows_}, {cols}] matrix holds {want.dtype} {list(want.shape)}")
            if glob.numel() != 1 or not glob.is_floating_point():
                raise UserError(f"{f.name}: tensor {prefix + '.' + leaves[2]!r} has shape {list(glob.shape)}; "
                                "the global scale is one fp32 number")
            problem = k.check(packed, scale, glob.float().reshape(1))
            if problem:
                raise UserError(f"{f.name}: tensor {prefix + '.' + leaves[2]!r}: {problem}; the checkpoint is damaged")
            dst[0].copy_(packed)
            dst[1].copy_(scale)
            dst[2].fill_(glob.float().item())
    return state


# ---- GGUF type 40 ----------------------------------------------------------------------------------------------
# llama.cpp's layout (conversion/base.py `_repack_nvfp4`, `_flush_nvfp4_experts`; src/llama-model.cpp's generic pass
# over ".scale" tensors): a type-40 `<base>.weight` may bring an F32 `<base>.scale`, a multiplier applied after the
# matmul (ModelOpt's weight_scale_2; 1 / compressed-tensors' global), [1] for a matrix and [E] per expert, absent
# where 1 (as ggml's own quantizer writes: `quantize --type nvfp4`), and `<base>.input_scale` (read past: W4A16).
# Experts come fused (`ffn_gate_up_exps`, no scale: llama.cpp loads none for it) or as the converter splits them,
# `ffn_gate_exps` + `ffn_up_exps`. `ffn_down_exps.scale` is Gemma 4's router.per_expert_scale with each expert's
# scale_2 folded in (conversion/gemma.py `Gemma4Model._generate_nvfp4_tensors`): one per-expert multiplier of the
# down output either way, so it stays the router's and the down's global is 1.

GGUF_TYPE = 40  # GGML_TYPE_NVFP4 (kernels/nvfp4.py's blocks)


def _gguf_scale(f, gname: str, gnames) -> str | None:
    """The name of type-40 tensor `gname`'s global-scale tensor, unless the model itself names a tensor so."""
    s = gname.removesuffix(".weight") + ".scale"
    return s if s in f.tensors and s not in gnames else None


def gguf_split(f, names: dict[str, str], expected: dict, path: str) -> dict[str, tuple[str, str]]:
    """Our fused `experts.gate_up_proj` names whose file holds the converter's split type-40 gate and up instead,
    each checked ([E, I, H], type 40)."""
    out = {}
    for name, g in names.items():
        pair = (g.replace("gate_up", "gate"), g.replace("gate_up", "up"))
        if g.endswith("ffn_gate_up_exps.weight") and g not in f.tensors and pair[0] in f.tensors:
            e, two_i, h = expected[name]
            for p in pair:
                info = f.tensors.get(p)
                if info is None or info.type != GGUF_TYPE or info.shape != (e, two_i // 2, h):
                    raise UserError(f"{path}: tensor {p!r} must be NVFP4 of shape {[e, two_i // 2, h]} beside "
                                    f"{pair[0]!r} (llama.cpp's split experts)")
            out[name] = pair
    return out


def gguf_scale_names(f, gnames: set[str]) -> set[str]:
    """The extra tensors type-40 weights among `gnames` bring (global and input scales)."""
    out = set()
    for g in gnames:
        if g in f.tensors and f.tensors[g].type == GGUF_TYPE:
            out |= {_gguf_scale(f, g, gnames), g.removesuffix(".weight") + ".input_scale"} & f.tensors.keys()
    return out


def _gguf_read(f, gname: str, gnames, path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed, scale, global per row) of type-40 tensor `gname`, its global from `<base>.scale` (1 without)."""
    import numpy as np

    from dgcli.kernels import nvfp4 as k

    info, s = f.tensors[gname], _gguf_scale(f, gname, gnames)
    lead = info.shape[0] if len(info.shape) == 3 else 1
    glob = torch.from_numpy(np.array(f.array(s), dtype=np.float32)).reshape(-1) if s else torch.ones(lead)
    if glob.numel() != lead or not bool(torch.isfinite(glob).all() and (glob > 0).all()):
        raise UserError(f"{path}: tensor {s!r} must hold {lead} finite positive global scale(s) (llama.cpp's "
                        f"scale_2: one per {'expert' if lead > 1 else 'matrix'})")
    packed, scale = k.from_gguf_blocks(torch.from_numpy(np.array(f.array(gname))).reshape(*info.shape[:-1], -1),
                                       info.shape[-1])
    return packed, scale, glob.reshape(-1, *[1] * (len(info.shape) - 2)).expand(*info.shape[:-1]).contiguous()


def gguf_modules_(f, model, names: dict[str, str], path: str, split: dict[str, tuple[str, str]]) -> None:
    """Swap NVFP4 modules in for the type-40 tensors of GGUF file `f` (model: on meta; names: our state-dict name ->
    GGUF name; split: `gguf_split`'s), their blocks converted to the held layout, the globals multipliers."""
    from dgcli.model.fp8 import _set
    from dgcli.model.nvfp4 import NVFP4Experts, NVFP4Linear

    gnames = set(names.values())
    halves: dict[int, list[str]] = {}  # layer -> its experts' type-40 tensors (both halves, or neither)
    for name, gname in [*names.items(), *split.items()]:
        if isinstance(gname, tuple):  # the converter's gate and up: one fused stack, each half its own globals
            got = [_gguf_read(f, g, gnames, path) for g in gname]
            held, gname = [torch.cat(t, dim=1) for t in zip(*got)], gname[0]
        elif f.tensors[gname].type == GGUF_TYPE:
            held = _gguf_read(f, gname, gnames, path)
        else:
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer, part = int(name.split(".")[1]), name.rsplit(".", 1)[1]
            mod = model.layers[layer].experts
            if not isinstance(mod, NVFP4Experts):
                e, two_i, h = mod.gate_up_proj.shape
                mod = model.layers[layer].experts = NVFP4Experts(e, h, two_i // 2, divide=False)
            halves.setdefault(layer, []).append(gname)
        else:
            module = name.removesuffix(".weight")
            old = model.get_submodule(module)
            if not isinstance(old, torch.nn.Linear):
                raise UserError(f"{path}: tensor {gname!r} is NVFP4; dgemma runs NVFP4 linears and experts only")
            mod, part = NVFP4Linear(old.in_features, old.out_features, divide=False), "weight"
            _set(model, module, mod)
        for attr, t in zip(("weight_packed" if part == "weight" else part, f"{part}_scale", f"{part}_global"), held):
            setattr(mod, attr, t)
    for layer, got in halves.items():
        if len(got) != 2:
            raise UserError(f"{path}: tensor {got[0]!r} is NVFP4 but the other half of layer {layer}'s experts is not; "
                            "dgemma runs a layer's experts in one format")
