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

GGUF_TYPE = 40  # GGML_TYPE_NVFP4 (kernels/nvfp4.py's blocks)


def _gguf_scale(f, gname: str, names: dict[str, str]) -> str | None:
    """The name of a type-40 tensor's global-scale tensor (`<base>.scale`, llama.cpp's scale naming), unless the
    model already names a tensor so (`ffn_down_exps.scale` is Gemma 4's per-expert router scale)."""
    s = gname.removesuffix(".weight") + ".scale"
    return s if s in f.tensors and s not in names.values() else None


def gguf_scale_names(f, names: dict[str, str]) -> set[str]:
    """The extra tensors type-40 weights bring (global and input scales)."""
    out = set()
    for g in names.values():
        if g in f.tensors and f.tensors[g].type == GGUF_TYPE:
            s = _gguf_scale(f, g, names)
            out |= {s} if s else set()
            out |= {g.removesuffix(".weight") + ".input_scale"} & f.tensors.keys()
    return out


def gguf_modules_(f, model, names: dict[str, str], path: str) -> None:
    """Swap NVFP4 modules in for the type-40 tensors of GGUF file `f` (model: on meta; names: our state-dict name ->
    GGUF name), their blocks converted to the held layout; the global scale (a multiplier) from `<base>.scale`,
    1 where the file has none (ggml's own quantizer writes none)."""
    import numpy as np

    from dgcli.kernels import nvfp4 as k
    from dgcli.model.fp8 import _set
    from dgcli.model.nvfp4 import NVFP4Experts, NVFP4Linear

    halves: dict[int, list[str]] = {}  # layer -> its experts' type-40 tensors (both halves, or neither)
    for name, gname in names.items():
        info = f.tensors[gname]
        if info.type != GGUF_TYPE:
            continue
        s = _gguf_scale(f, gname, names)
        glob = torch.from_numpy(np.array(f.array(s), dtype=np.float32)).reshape(-1) if s else torch.ones(1)
        packed, scale = k.from_gguf_blocks(torch.from_numpy(np.array(f.array(gname))).reshape(*info.shape[:-1], -1),
                                           info.shape[-1])
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer, part = int(name.split(".")[1]), name.rsplit(".", 1)[1]
            mod = model.layers[layer].experts
            if not isinstance(mod, NVFP4Experts):
                e, two_i, h = mod.gate_up_proj.shape
                mod = model.layers[layer].experts = NVFP4Experts(e, h, two_i // 2, divide=False)
            want = getattr(mod, part).shape[:2]
            halves.setdefault(layer, []).append(gname)
        else:
            module = name.removesuffix(".weight")
            old = model.get_submodule(module)
            if not isinstance(old, torch.nn.Linear):
                raise UserError(f"{path}: tensor {gname!r} is NVFP4; dgemma runs NVFP4 linears and experts only")
            mod, part, want = NVFP4Linear(old.in_features, old.out_features, divide=False), "weight", info.shape[:1]
            _set(model, module, mod)
        if glob.numel() not in (1, want[0]) or not bool(torch.isfinite(glob).all() and (glob > 0).all()):
            raise UserError(f"{path}: tensor {s!r} must hold one finite positive global scale (or one per expert)")
        held = "weight_packed" if part == "weight" else part
        setattr(mod, held, packed)
        setattr(mod, f"{part}_scale", scale)
        setattr(mod, f"{part}_global", glob.reshape(-1, *[1] * (len(want) - 1)).expand(*want).contiguous())
    for layer, got in halves.items():
        if len(got) != 2:
            raise UserError(f"{path}: tensor {got[0]!r} is NVFP4 but the other half of layer {layer}'s experts is not; "
                            "dgemma runs a layer's experts in one format")
