"""A checkpoint directory (spec §3): single-file or sharded safetensors, plain, compressed-tensors FP8 (model/fp8.py
modules at one byte per parameter, per-expert tensors read into the fused layout: checkpoint/compressed_tensors.py)
or NVFP4 (checkpoint/nvfp4.py), and the vision tower (checkpoint/vision.py). The model is built on meta and every
tensor assigned straight from the file: no second full copy. Owns: the checkpoint <-> module name map and every
loading error of a directory. Must not: do math, or decide a path's format (checkpoint/load.py does).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn
from safetensors import SafetensorError, safe_open

from dgcli.checkpoint import compressed_tensors as ct
from dgcli.checkpoint import nvfp4
from dgcli.checkpoint.config import directory_config, parse_config, read_json, safetensors_header
from dgcli.checkpoint.meta import meta_model
from dgcli.checkpoint.vision import VISION, new_vision
from dgcli.errors import UserError
from dgcli.model import fp8
from dgcli.model import nvfp4 as model_nvfp4
from dgcli.model.config import ModelConfig
from dgcli.model.gemma import DiffusionGemma

DECODER = "model.decoder."
ENC_SCALAR = re.compile(r"^model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")


def to_module_name(key: str) -> str:
    """Checkpoint key -> our module key (the vision tower's under `vision.`; a key not ours is reported as such)."""
    if key.startswith(VISION):
        return "vision." + key[len("model.encoder."):]
    if key.startswith(DECODER):
        return key[len(DECODER):]
    m = ENC_SCALAR.match(key)
    return f"layers.{m.group(1)}.encoder_layer_scalar" if m else key


def to_checkpoint_name(name: str) -> str:
    """Our module key -> the checkpoint key (the inverse of `to_module_name`)."""
    if name.startswith("vision."):
        return "model.encoder." + name[len("vision."):]
    if name.endswith(".encoder_layer_scalar"):
        return "model.encoder.language_model." + name.replace("encoder_layer_scalar", "layer_scalar")
    return DECODER + name


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (via the index when sharded)."""
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory; pass --model DIR with config.json and *.safetensors")
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: has no 'weight_map'; re-download the index file")
        files = {f: path / f for f in set(weight_map.values())}
        for f in sorted(files.values()):
            if not f.exists():
                raise UserError(f"{f}: shard listed in {index.name} is missing; download it again")
        return {name: files[f] for name, f in weight_map.items()}
    singles = sorted(path.glob("model*.safetensors"))
    if not singles:
        raise UserError(f"{path}: no model.safetensors or model.safetensors.index.json; is the download complete?")
    out: dict[str, Path] = {}
    for f in singles:
        with _open(f) as st:
            out.update({k: f for k in st.keys()})
    return out


def _open(f: Path, device: str = "cpu"):
    try:
        return safe_open(str(f), framework="pt", device=device)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{f}: not a readable safetensors file ({e}); it may be truncated or corrupt: download it again") from None


def load_state(path: Path, cfg: ModelConfig, files: dict[str, Path], expected: dict[str, torch.Size],
               keep: frozenset[str], device: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Read every tensor once, checked against the shapes the model implies, cast to `dtype` as read but for `keep`
    (FP8 weights and scales: as stored). Per-expert tensors (`experts.{i}.gate_proj.weight`..., the quantized
    layout) are read straight into the fused tensors."""
    wanted: dict[str, str] = {}  # module name -> checkpoint key
    pieces: dict[str, list[str]] = {}  # fused expert tensor -> its per-expert module keys
    unexpected = []  # reported after what is missing (a partial vision tower: a shard missing)
    for key, f in files.items():
        name = to_module_name(key)
        slot = ct.expert_slot(name, cfg.moe_intermediate_size)
        target = slot[0] if slot else name
        if target not in expected:
            if key != "lm_head.weight":  # a tied head saved explicitly: the embedding serves
                unexpected.append(f"{f.name}: unexpected tensor {key!r}; config.json does not describe these weights")
            continue
        if slot and slot[1] >= cfg.num_experts:
            raise UserError(f"{f.name}: tensor {key!r} is expert {slot[1]}; config.json has {cfg.num_experts} experts")
        wanted[name] = key
        if slot:
            pieces.setdefault(target, []).append(name)
    missing = [n for n in expected if n not in wanted and n not in pieces]
    for target in pieces:  # every expert's gate, up and down (and scales), or a shard is missing
        layer = int(target.split(".")[1])
        need = [n for e in range(cfg.num_experts) for n in ct.expert_keys(layer, e, target in keep)]
        missing += [n for n in need if n not in wanted and ct.expert_slot(n, 1)[0] == target]
    if missing:
        raise UserError(f"{path}: checkpoint lacks tensor {to_checkpoint_name(missing[0])!r}"
                        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; is a shard missing?")
    if unexpected:
        raise UserError(unexpected[0])
    by_file: dict[Path, list[str]] = {}
    for name, key in wanted.items():
        by_file.setdefault(files[key], []).append(name)
    state: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        experts = [n for n in names if ct.expert_slot(n, 1) is not None]  # read below, straight into their tensors
        with _open(f, device) as st:
            for name in names:
                if name in experts:
                    continue
                key = wanted[name]
                try:
                    t = st.get_tensor(key)
                except (SafetensorError, OSError, ValueError) as e:
                    raise UserError(f"{f}: tensor {key!r} cannot be read ({e}); the file may be truncated") from None
                _check(f, key, t.dtype, t.shape, expected[name], name in keep)
                state[name] = t.to(dtype) if dtype is not None and name not in keep else t
        if experts:
            _read_experts(f, experts, wanted, cfg, state, expected, keep, device)
    return state


def _check(f: Path, key: str, dt: torch.dtype, shape, want, quantized: bool) -> None:
    if not dt.is_floating_point:
        raise UserError(f"{f.name}: tensor {key!r} has dtype {dt}; expected a floating-point tensor")
    if quantized and not key.endswith("_scale") and dt != fp8.FP8:
        raise UserError(f"{f.name}: tensor {key!r} has dtype {dt}; a quantized weight must be float8_e4m3fn")
    if want is not None and tuple(shape) != tuple(want):
        raise UserError(f"{f.name}: tensor {key!r} has shape {list(shape)}, config.json implies {list(want)}")


ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
             "F64": torch.float64}


def _read_experts(f: Path, names: list[str], wanted: dict[str, str], cfg: ModelConfig, state: dict,
                  expected: dict, keep: frozenset[str], device: str) -> None:
    """Per-expert tensors of one file read with plain file reads into their fused tensors (allocated at the
    first piece, in its stored dtype): copying out of the memory map instead would leave the mapped pages
    resident next to the copy, twice the experts' bytes."""
    header, start = safetensors_header(f)
    try:
        with open(f, "rb") as fh:
            for name in names:
                key = wanted[name]
                meta = header[key]
                target, e, rows = ct.expert_slot(name, cfg.moe_intermediate_size)
                dt = ST_DTYPES.get(meta["dtype"])
                if dt is None:
                    raise UserError(f"{f.name}: tensor {key!r} has dtype {meta['dtype']}; expected a floating-point tensor")
                if target not in state:
                    state[target] = torch.empty(tuple(expected[target]), dtype=dt, device=device)
                dst = state[target][e, rows]
                _check(f, key, dt, meta["shape"], dst.shape, target in keep)
                if dt != dst.dtype:
                    raise UserError(f"{f.name}: tensor {key!r} has dtype {dt}, other experts' {dst.dtype}")
                begin, end = meta["data_offsets"]
                host = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=dt)
                fh.seek(start + begin)
                if fh.readinto(host.view(torch.uint8).numpy().reshape(-1)) != end - begin:
                    raise UserError(f"{f}: tensor {key!r} is cut short; the file may be truncated")
                if host is not dst:
                    dst.copy_(host)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{f}: not a readable safetensors file ({e}); it may be truncated or corrupt") from None


def _convert_quantized(model: DiffusionGemma, cfg: ModelConfig, files: dict[str, Path], path: Path) -> None:
    """FP8 modules wherever the checkpoint stores a `weight_scale`: its linears, and experts stored per expert."""
    linears, experts = set(), set()
    for key, f in files.items():
        name = to_module_name(key)
        if not name.endswith(".weight_scale"):
            continue
        m = ct.EXPERT_KEY.match(name)
        if m:
            experts.add(int(m.group(1)))
            continue
        module = name.removesuffix(".weight_scale")
        try:
            ok = isinstance(model.get_submodule(module), nn.Linear)
        except AttributeError:
            ok = False
        if not ok:
            raise UserError(f"{f.name}: tensor {key!r}: dgemma runs quantized linears and experts only, "
                            f"not a quantized {module!r}")
        linears.add(module)
    if not linears and not experts:
        raise UserError(f"{path}: config.json's quantization_config says {cfg.quantization.scheme} "
                        "but no tensor has a weight_scale; is this checkpoint quantized?")
    fp8.convert_(model, linears, {e for e in experts if e < cfg.num_hidden_layers}, torch.bfloat16)


def resolve_dtype(name: str | None, default: torch.dtype | None = None) -> torch.dtype | None:
    if name in (None, "auto"):
        return default
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
             "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise UserError(f"unknown dtype {name!r}; use auto, bfloat16 or float32")
    return table[name]


def load_directory(path: Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype | str | None = None) -> DiffusionGemma:
    """Load a checkpoint directory. dtype None = the checkpoint's (its embedding's dtype)."""
    path = Path(path)
    cfg = parse_config(directory_config(path), source=str(path / "config.json"))
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype)
    model = meta_model(cfg)
    all_files = files = checkpoint_files(path)
    if any(k.startswith(VISION) for k in files):  # the tower and projector, never quantized
        model.vision = new_vision(cfg, str(path / "config.json"))
    if model.vision is None:
        files = {k: f for k, f in files.items() if not k.startswith(VISION)}
    q4 = cfg.quantization is not None and cfg.quantization.nvfp4
    if q4:  # NVFP4 modules where the checkpoint holds a global scale; their tensors read apart (checkpoint/nvfp4.py)
        q4_modules, q4_keys = nvfp4.plan(files, cfg.quantization.layout, to_module_name)
        if not q4_modules:
            raise UserError(f"{path}: config.json's quantization_config says {cfg.quantization.scheme} "
                            "but no tensor has a global scale; is this checkpoint quantized?")
        fp8.convert_(model, *nvfp4.targets(q4_modules, cfg.num_hidden_layers),
                     cfg.quantization.layout == "compressed-tensors", model_nvfp4.KINDS)
        files = {k: f for k, f in files.items() if k not in q4_keys}
    elif cfg.quantization is not None:
        _convert_quantized(model, cfg, files, path)
    keep = frozenset(fp8.quantized_names(model) | model_nvfp4.quantized_names(model))
    expected = {k: v.shape for k, v in model.state_dict().items() if not (q4 and k in keep)}
    dev = str(device)
    state = load_state(path, cfg, files, expected, keep, dev, dtype)
    if q4:
        state.update({k: t.to(dev) for k, t in nvfp4.read(q4_modules, all_files, cfg.quantization.layout, model,
                                                          _open).items()})
    # Every tensor in one dtype, the layer scalars included: transformers loaded in a dtype rounds every
    # parameter and buffer to it (the released checkpoint stores the scalars in fp32; in bf16 the reference
    # multiplies by the bf16-rounded scalar). Its only fp32 buffers are the RoPE inverse frequencies,
    # which we compute in fp32 (`gemma.inv_freq_for`). Mixed-dtype checkpoints run in the embedding's dtype.
    model_dtype = dtype or state["embed_tokens.weight"].dtype
    for name, t in state.items():
        if t.dtype != model_dtype and name not in keep:
            state[name] = t.to(model_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
