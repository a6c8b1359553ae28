"""A checkpoint's `config.json` parsed into `ModelConfig` (spec §1) and its `quantization_config` (a scheme dgemma
does not run is one error naming it); unknown keys ignored (the checkpoint is not ours). Also reading a checkpoint's
JSON files, its safetensors headers and the shipped 26B-A4B config. Must not: read weights, touch torch, or decide a
path's format.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from dgcli.errors import UserError
from dgcli.model.config import FULL, SLIDING, ModelConfig, Quantization, RopeSpec

# The released checkpoint's rope_parameters (spec §1.2), also transformers' DiffusionGemmaConfig
# default; used when config.json has none, and written by `make_config`.
RELEASED_ROPE_PARAMETERS: dict[str, dict] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


def _rope(params: dict, head_dim: int, what: str) -> RopeSpec:
    kind = params.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise UserError(f"config.json: rope_type {kind!r} for {what} is not supported (default|proportional)")
    factor = float(params.get("partial_rotary_factor", 1.0))
    pairs = int(factor * head_dim // 2)
    return RopeSpec(theta=float(params.get("rope_theta", 10000.0)), head_dim=head_dim, rotary_pairs=pairs)


def layer_types_for(listed: list | None, n: int) -> list[str]:
    """The listed layer types, else the released pattern (every sixth full); the last layer full, as the reference."""
    types = list(listed or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    types[-1] = FULL
    return types


def parse_config(raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Flatten a DiffusionGemma `config.json` (top level + nested `text_config`)."""
    if raw.get("model_type") != "diffusion_gemma":
        raise UserError(
            f"{source}: model_type is {raw.get('model_type')!r}, not 'diffusion_gemma'; "
            "point --model at a DiffusionGemma checkpoint"
        )
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"{source}: missing the nested 'text_config' object of a DiffusionGemma config")
    try:
        n_layers = int(text["num_hidden_layers"])
        head_dim = int(text.get("head_dim", 256))
        n_kv = int(text["num_key_value_heads"])
        layer_types = layer_types_for(text.get("layer_types"), n_layers)
        if len(layer_types) != n_layers or any(t not in (SLIDING, FULL) for t in layer_types):
            raise UserError(f"{source}: layer_types must list {n_layers} of {SLIDING!r}/{FULL!r}")
        # Two spellings, read as transformers' DiffusionGemmaTextConfig reads them: the released checkpoint's
        # `global_head_dim` / `num_global_key_value_heads`, and save_pretrained's `per_layer_config` (overrides by
        # layer index of the values that differ from the base ones; with it, `global_head_dim` is ignored).
        if "per_layer_config" in text:
            global_head_dim, n_global_kv = head_dim, n_kv
            full = {}
            for idx, ov in (text.get("per_layer_config") or {}).items():
                i = int(idx)
                if not 0 <= i < n_layers:
                    raise UserError(f"{source}: per_layer_config names layer {idx}, past the {n_layers} layers")
                if layer_types[i] == FULL:
                    full[i] = (int(ov.get("head_dim", head_dim)), int(ov.get("num_key_value_heads", n_kv)))
                elif {"head_dim", "num_key_value_heads"} & set(ov):
                    raise UserError(f"{source}: per_layer_config overrides the attention of sliding layer {idx}; "
                                    "dgemma runs one geometry per layer type")
            shapes = {full.get(i, (head_dim, n_kv)) for i, t in enumerate(layer_types) if t == FULL}
            if len(shapes) > 1:
                raise UserError(f"{source}: per_layer_config gives the full-attention layers different head dims "
                                f"or kv heads {sorted(shapes)}; dgemma runs one geometry per layer type")
            global_head_dim, n_global_kv = shapes.pop()
        else:
            global_head_dim = int(text.get("global_head_dim", 512))
            n_global_kv = text.get("num_global_key_value_heads")
            n_global_kv = int(n_global_kv) if n_global_kv is not None else n_kv
        if text.get("use_bidirectional_attention") == "all":
            raise UserError(f"{source}: use_bidirectional_attention='all' is not supported (text models use 'vision')")
        rope = text.get("rope_parameters") or RELEASED_ROPE_PARAMETERS
        eos = raw.get("eos_token_id", text.get("eos_token_id", 1))
        eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
        n_heads = int(text["num_attention_heads"])
        for kv in (n_kv, n_global_kv):
            if n_heads % kv:
                raise UserError(f"{source}: num_attention_heads {n_heads} is not a multiple of kv heads {kv}")
        return ModelConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            num_global_key_value_heads=n_global_kv,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            num_experts=int(text["num_experts"]),
            top_k_experts=int(text["top_k_experts"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            sliding_window=int(text.get("sliding_window", 1024)),
            layer_types=tuple(layer_types),
            rope_sliding=_rope(rope[SLIDING], head_dim, SLIDING),
            rope_full=_rope(rope[FULL], global_head_dim, FULL),
            final_logit_softcapping=text.get("final_logit_softcapping", 30.0),
            canvas_length=int(raw.get("canvas_length", 256)),
            # No such key in the released checkpoint: the SC MLP width is intermediate_size (spec §1.1).
            self_conditioning_size=int(raw.get("self_conditioning_size", text["intermediate_size"])),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            pad_token_id=int(text.get("pad_token_id", 0) or 0),
            eos_token_ids=eos_ids,
            dtype=str(raw.get("dtype") or text.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            quantization=parse_quantization(raw, source),
            raw=raw,
        )
    except KeyError as e:
        raise UserError(f"{source}: text_config lacks the key {e.args[0]!r}") from None


# ---- quantization_config ------------------------------------------------------------------------------

SUPPORTED = ("dgemma runs compressed-tensors FP8 checkpoints (FP8_DYNAMIC or FP8 weight-only: float-quantized "
             "e4m3 weights, one scale per output channel), NVFP4 ones (compressed-tensors nvfp4-pack-quantized, "
             "ModelOpt NVFP4) and unquantized ones; use the bf16 checkpoint, or make a quantized one with "
             "`dgemma quantize SRC DST --fp8` (or --nvfp4)")


def _ct_scheme(group: dict) -> str:
    """A compressed-tensors config group's preset name (quant_scheme's), or its weights/activations spelled out."""
    w, a = group.get("weights") or {}, group.get("input_activations")
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    gs = w.get("group_size")
    if kind == "float" and bits == 8:
        if strategy == "channel" and not a:
            return "FP8 weight-only"
        if strategy == "channel" and a.get("strategy") == "token" and a.get("dynamic") is True:
            return "FP8_DYNAMIC"
        if strategy == "block":
            return "FP8_BLOCK"
        if strategy == "tensor":
            return "FP8 (per-tensor, static activations)" if a and a.get("dynamic") is False else "FP8 (per-tensor)"
    if kind == "float" and bits == 4:
        return ("NVFP4" if a else "NVFP4A16") if gs == 16 else ("MXFP4" if a else "MXFP4A16")
    if kind == "int" and bits in (4, 8):
        act = f"A{a.get('num_bits')}" if a else "A16"
        return f"W{bits}{act} (int{bits} weights, {strategy}{f' {gs}' if gs else ''})"
    return f"{bits}-bit {kind} weights, {strategy} strategy" + (f", {a.get('num_bits')}-bit activations" if a else "")


def _other_scheme(q: dict) -> str:
    """Another quantizer's config named as its own fields name it (GPTQ, AWQ, bitsandbytes, fp8, modelopt...)."""
    parts = [str(q.get("quant_method"))]
    for key in ("quant_algo", "bits", "w_bit", "group_size", "q_group_size", "weight_block_size", "fmt",
                "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type"):
        if q.get(key) not in (None, False):
            parts.append(f"{key}={q[key]}")
    return " ".join(parts)


def parse_quantization(raw: dict[str, Any], source: str = "config.json") -> Quantization | None:
    """config.json's `quantization_config` (top level or in text_config), checked: None when absent; one
    UserError naming the scheme for anything dgemma does not run."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise UserError(f"{source}: quantization_config is not an object")
    method = q.get("quant_method")
    if method == "modelopt":  # transformers' spelling of hf_quant_config.json (its "quantization" object, or flat)
        algo = (q.get("quantization") or q).get("quant_algo")
        if algo != "NVFP4":
            raise UserError(f"{source}: quantization scheme {_other_scheme(q)} is not supported; {SUPPORTED}")
        return Quantization(scheme="NVFP4", layout="modelopt",
                            ignore=tuple(map(str, (q.get("quantization") or q).get("exclude_modules") or ())))
    if method != "compressed-tensors":
        raise UserError(f"{source}: quantization scheme {_other_scheme(q)} is not supported; {SUPPORTED}")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise UserError(f"{source}: compressed-tensors quantization_config has no config_groups")
    names = {_ct_scheme(g if isinstance(g, dict) else {}) for g in groups.values()}
    fmt = q.get("format")
    formats = {g.get("format") or fmt for g in groups.values() if isinstance(g, dict)}
    nvfp4 = names <= {"NVFP4", "NVFP4A16"} and formats == {"nvfp4-pack-quantized"}
    bad = set() if nvfp4 else names - {"FP8_DYNAMIC", "FP8 weight-only"}
    if bad or not nvfp4 and formats - {"float-quantized", "naive-quantized"}:
        name = sorted(bad)[0] if bad else sorted(names)[0]
        raise UserError(f"{source}: quantization scheme {name} (compressed-tensors, format "
                        f"{'/'.join(sorted(map(str, formats)))}) is not supported; {SUPPORTED}")
    for g in groups.values():
        w = g.get("weights") or {}
        if w.get("symmetric") is False or w.get("dynamic") not in (False, None):
            raise UserError(f"{source}: FP8 weights with zero points or dynamic weight scales are not supported; {SUPPORTED}")
    for key, what in (("kv_cache_scheme", "an FP8 KV cache (kv_cache_scheme)"),
                      ("sparsity_config", "sparse weights (sparsity_config)"),
                      ("transform_config", "rotated weights (transform_config)")):
        if q.get(key):
            raise UserError(f"{source}: compressed-tensors quantization with {what} is not supported; {SUPPORTED}")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise UserError(f"{source}: quantization_status {status!r}: dgemma reads compressed checkpoints "
                        "(e4m3 weights stored as such), not weights saved before compression")
    ignore = q.get("ignore") or []
    if nvfp4:  # W4A4 (input_global_scale): activations are never FP4 (W4A16 as vLLM on Hopper; W4A8 in a VNNI CPU's C)
        return Quantization(scheme="NVFP4" if "NVFP4" in names else "NVFP4A16", ignore=tuple(map(str, ignore)))
    return Quantization(scheme="FP8_DYNAMIC" if "FP8_DYNAMIC" in names else "FP8 weight-only",
                        ignore=tuple(map(str, ignore)))


def directory_config(path: Path) -> dict:
    """A checkpoint directory's config.json, ModelOpt's hf_quant_config.json folded in as its missing
    `quantization_config` (older ModelOpt exports keep it only there)."""
    raw = read_json(path / "config.json")
    hq = path / "hf_quant_config.json"
    if not raw.get("quantization_config") and hq.is_file():
        raw["quantization_config"] = {"quant_method": "modelopt", **read_json(hq)}
    return raw


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file as a dict; one line naming the file and the fix when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: file not found; a DiffusionGemma checkpoint directory needs it") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a JSON file; a checkpoint holds it as a file") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a JSON text file (not UTF-8); re-download or fix the file") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); re-download or fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, found a {type(data).__name__}; re-download or fix the file")
    return data


def safetensors_header(f: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and the offset its data starts at, checked against the file's size as
    safetensors' loader checks it: one error line for a file that is not one."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        try:
            (n,) = struct.unpack("<Q", fh.read(8))
            if 8 + n > size:  # checked before reading: a garbage length would be read whole
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(fh.read(n))
            end = 8 + n + max((m["data_offsets"][1] for k, m in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise UserError(f"{f}: not a readable safetensors file ({e}); it may be truncated or corrupt: download it "
                            "again") from None
    if end != size:
        raise UserError(f"{f}: {'truncated' if size < end else 'corrupt'} safetensors file: its header describes "
                        f"{end} bytes, the file has {size}; download it again (or re-copy it)")
    return header, 8 + n


PACKAGED = Path(__file__).resolve().parents[1] / "data"


def real_config_path() -> Path:
    """The released 26B-A4B config.json shipped with dgemma (for --dummy and info)."""
    return PACKAGED / "diffusiongemma-26B-A4B" / "config.json"
