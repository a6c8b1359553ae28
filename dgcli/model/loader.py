"""Load a DiffusionGemma checkpoint directory into `model.DiffusionGemma` (spec §3).

Single-file or sharded safetensors; the model is built on the `meta` device and every tensor is
assigned straight from the file, so no second full copy is made. Vision tensors are never read.
Owns: the checkpoint <-> module name map and every loading error message. Must not: do math.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from safetensors import SafetensorError, safe_open

from dgcli.model.config import ModelConfig, load_config, read_json
from dgcli.errors import UserError
from dgcli.model.gemma import DiffusionGemma

DECODER = "model.decoder."
ENC_SCALAR = re.compile(r"^model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")
VISION = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def to_module_name(key: str) -> str | None:
    """Checkpoint key -> our module key; None for tensors text generation never reads (vision)."""
    if key.startswith(VISION):
        return None
    if key.startswith(DECODER):
        return key[len(DECODER):]
    m = ENC_SCALAR.match(key)
    if m:
        return f"layers.{m.group(1)}.encoder_layer_scalar"
    return key  # not ours: reported as unexpected


def to_checkpoint_name(name: str) -> str:
    """Our module key -> the checkpoint key (the inverse of `to_module_name`)."""
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


def load_state(path: Path, cfg: ModelConfig, device: str = "cpu", dtype: torch.dtype | None = None,
               expected: dict[str, torch.Size] | None = None) -> dict[str, torch.Tensor]:
    """Read every text tensor once, checked against the shapes the config implies."""
    files = checkpoint_files(path)
    wanted: dict[str, str] = {}  # module name -> checkpoint key
    for key, f in files.items():
        name = to_module_name(key)
        if name is None:
            continue
        if expected is not None and name not in expected:
            if key == "lm_head.weight":
                continue  # a tied head saved explicitly: the embedding serves
            raise UserError(f"{f.name}: unexpected tensor {key!r}; config.json does not describe these weights")
        wanted[name] = key
    if expected is not None:
        missing = [n for n in expected if n not in wanted]
        if missing:
            raise UserError(f"{path}: checkpoint lacks tensor {to_checkpoint_name(missing[0])!r}"
                            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; is a shard missing?")
    by_file: dict[Path, list[str]] = {}
    for name, key in wanted.items():
        by_file.setdefault(files[key], []).append(name)
    state: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        with _open(f, device) as st:
            for name in names:
                key = wanted[name]
                try:
                    t = st.get_tensor(key)
                except (SafetensorError, OSError, ValueError) as e:
                    raise UserError(f"{f}: tensor {key!r} cannot be read ({e}); the file may be truncated") from None
                if not t.is_floating_point():
                    raise UserError(f"{f.name}: tensor {key!r} has dtype {t.dtype}; expected a floating-point tensor")
                if expected is not None and t.shape != expected[name]:
                    raise UserError(f"{f.name}: tensor {key!r} has shape {list(t.shape)}, "
                                    f"config.json implies {list(expected[name])}")
                if dtype is not None and t.dtype != dtype:
                    t = t.to(dtype)
                state[name] = t
    return state


# torch.nn.init functions the modules' constructors call; skipped on the meta device (see `meta_model`).
_INIT_FNS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "ones_", "zeros_",
             "constant_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    saved = {n: getattr(nn.init, n) for n in _INIT_FNS}
    try:
        for n in _INIT_FNS:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def meta_model(cfg: ModelConfig) -> DiffusionGemma:
    """The module tree on the meta device, parameter init skipped: init ops on meta tensors go through
    torch._refs, which imports torch._dynamo (~1 s of start-up), and every value is assigned later anyway."""
    with torch.device("meta"), _no_init():
        return DiffusionGemma(cfg)


def resolve_dtype(name: str | None, default: torch.dtype | None = None) -> torch.dtype | None:
    if name in (None, "auto"):
        return default
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
             "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise UserError(f"unknown dtype {name!r}; use auto, bfloat16 or float32")
    return table[name]


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None) -> DiffusionGemma:
    """Load a checkpoint directory. dtype None = the checkpoint's (its embedding's dtype)."""
    path = Path(path)
    cfg = load_config(path)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype)
    model = meta_model(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    dev = str(device)
    state = load_state(path, cfg, device=dev, dtype=dtype, expected=expected)
    # Every tensor in one dtype, the layer scalars included: transformers loaded in a dtype rounds every
    # parameter and buffer to it (the released checkpoint stores the scalars in fp32; in bf16 the reference
    # multiplies by the bf16-rounded scalar). Its only fp32 buffers are the RoPE inverse frequencies,
    # which we compute in fp32 (`gemma.inv_freq_for`). Mixed-dtype checkpoints run in the embedding's dtype.
    model_dtype = dtype or state["embed_tokens.weight"].dtype
    for name, t in state.items():
        if t.dtype != model_dtype:
            state[name] = t.to(model_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
