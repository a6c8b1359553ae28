"""DiffusionGemma in a GGUF file (`general.architecture = diffusion-gemma`, llama.cpp's converter layout): its
metadata <-> our config.json and generation_config.json dicts, its tensor names <-> our module names, and loading:
F32/F16/BF16 tensors assigned memory-mapped (cast where the run dtype differs), quantized linears and experts as
`ggml.QuantLinear` / `ggml.QuantExperts` over the file's bytes or the mapped cache (checkpoint/mapped.py), a
quantized embedding (the tied head too) or router dequantized to the run dtype. Every loading error is one line.
Must not: parse bytes (checkpoint/gguf.py does) or compute with quantized blocks (model/ggml.py does).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType as V

from dgcli.errors import UserError
from dgcli.checkpoint import nvfp4
from dgcli.checkpoint.config import layer_types_for, parse_config
from dgcli.checkpoint.gguf import GGUFFile, Typed, open_gguf
from dgcli.model.config import FULL, SLIDING, ModelConfig

ARCH = "diffusion-gemma"
A = ARCH + "."

# Our module name (tail after `layers.N.`) -> llama.cpp's tensor name (after `blk.N.`).
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight", "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight", "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight", "layer_scalar": "layer_output_scale.weight",
    "encoder_layer_scalar": "enc_layer_output_scale.weight",
}
_GLOBAL = {
    "embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
    "self_conditioning.pre_norm.weight": "self_cond_pre_norm.weight",
    "self_conditioning.gate_proj.weight": "self_cond_gate.weight",
    "self_conditioning.up_proj.weight": "self_cond_up.weight",
    "self_conditioning.down_proj.weight": "self_cond_down.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # full layers' proportional RoPE as per-pair divisors (1e30: not rotated)
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


def to_gguf_name(name: str) -> str:
    """Our module key -> the GGUF tensor name (llama.cpp's)."""
    m = _LAYER_KEY.match(name)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    if name in _GLOBAL:
        return _GLOBAL[name]
    raise KeyError(name)


# ---- metadata --------------------------------------------------------------------------------------

def _f32(v: float) -> float:
    # The shortest decimal of the stored float32 (1e-6, not 9.99999997e-07): the config equals config.json's.
    return float(str(np.float32(v)))


def model_metadata(cfg: ModelConfig, gen: dict | None, *, name: str, file_type: int) -> dict[str, Any]:
    """The architecture and sampler keys of a GGUF file for `cfg` and its generation config, as llama.cpp's
    converter writes them, plus dgemma's own `diffusion.max_new_tokens` and `diffusion.eos_token_ids`."""
    swa = [t == SLIDING for t in cfg.layer_types]
    md: dict[str, Any] = {
        "general.architecture": ARCH, "general.type": "model", "general.name": name,
        A + "block_count": cfg.num_hidden_layers, A + "context_length": cfg.max_position_embeddings,
        A + "embedding_length": cfg.hidden_size, A + "feed_forward_length": cfg.intermediate_size,
        A + "attention.head_count": cfg.num_attention_heads,
        A + "attention.head_count_kv": Typed(V.INT32, [g.num_kv_heads for g in cfg.layers]),
        A + "rope.freq_base": Typed(V.FLOAT32, cfg.rope_full.theta),
        A + "rope.freq_base_swa": Typed(V.FLOAT32, cfg.rope_sliding.theta),
        A + "attention.layer_norm_rms_epsilon": Typed(V.FLOAT32, cfg.rms_norm_eps),
        A + "expert_count": cfg.num_experts, A + "expert_used_count": cfg.top_k_experts,
        A + "attention.key_length": cfg.global_head_dim, A + "attention.value_length": cfg.global_head_dim,
        A + "final_logit_softcapping": Typed(V.FLOAT32, cfg.final_logit_softcapping or 0.0),
        A + "attention.sliding_window": cfg.sliding_window, A + "attention.shared_kv_layers": 0,
        A + "embedding_length_per_layer_input": 0, A + "attention.sliding_window_pattern": swa,
        A + "attention.key_length_swa": cfg.head_dim, A + "attention.value_length_swa": cfg.head_dim,
        A + "expert_feed_forward_length": cfg.moe_intermediate_size,
        # As llama.cpp's Gemma-4 converter: full layers rotate "all" dims, `rope_freqs` switches pairs off.
        A + "rope.dimension_count": cfg.global_head_dim, A + "rope.dimension_count_swa": 2 * cfg.rope_sliding.rotary_pairs,
        A + "attention.causal": False,
        "diffusion.canvas_length": cfg.canvas_length,
        "general.quantization_version": 2, "general.file_type": file_type,
    }
    g = gen or {}
    sampler = g.get("sampler_config") or {}
    for key, value, typ in (("eb_max_steps", g.get("max_denoising_steps"), int),
                            ("eb_t_min", g.get("t_min"), float), ("eb_t_max", g.get("t_max"), float),
                            ("eb_entropy_bound", sampler.get("entropy_bound"), float),
                            ("eb_stability_threshold", g.get("stability_threshold"), int),
                            ("eb_confidence_threshold", g.get("confidence_threshold"), float),
                            ("max_new_tokens", g.get("max_new_tokens"), int)):
        if value is not None:
            md["diffusion." + key] = Typed(V.FLOAT32, float(value)) if typ is float else int(value)
    eos = g.get("eos_token_id")
    if eos is not None:
        md["diffusion.eos_token_ids"] = Typed(V.INT32, eos if isinstance(eos, list) else [eos])
    return md


def rope_freqs(cfg: ModelConfig) -> np.ndarray:
    """llama.cpp's `rope_freqs` for the full layers: 1 for each rotating pair, 1e30 for the pass-through ones."""
    r = cfg.rope_full
    return np.array([1.0] * r.rotary_pairs + [1e30] * (r.head_dim // 2 - r.rotary_pairs), dtype=np.float32)


def _need(md: dict, key: str, source: str):
    if key not in md:
        raise UserError(f"{source}: GGUF metadata lacks {key!r}; is it a complete DiffusionGemma conversion?")
    return md[key]


def config_dict(f: GGUFFile) -> dict:
    """The config.json dict (as `parse_config` takes it) a GGUF file's metadata and tensor shapes describe."""
    md, src = f.metadata, str(f.path)
    if md.get("general.architecture") != ARCH:
        raise UserError(f"{src}: GGUF architecture is {md.get('general.architecture')!r}, not {ARCH!r}; dgemma runs "
                        "DiffusionGemma GGUF files (llama.cpp's diffusion-gemma conversion)")
    n = int(_need(md, A + "block_count", src))
    pattern = md.get(A + "attention.sliding_window_pattern")
    types = layer_types_for(None if pattern is None else [SLIDING if bool(s) else FULL for s in pattern], n)
    kv = np.atleast_1d(np.asarray(_need(md, A + "attention.head_count_kv", src))).tolist()
    kv = kv * n if len(kv) == 1 else kv
    kv_of = {t: {int(k) for k, tt in zip(kv, types) if tt == t} for t in (SLIDING, FULL)}
    if len(kv) != n or any(len(s) > 1 for s in kv_of.values()):
        raise UserError(f"{src}: attention.head_count_kv {kv} is not one count per layer type; dgemma runs one "
                        "geometry per layer type")
    head_dim = int(md.get(A + "attention.key_length_swa", md.get(A + "attention.key_length", 256)))
    global_dim = int(md.get(A + "attention.key_length", head_dim))
    freqs = f.array(ROPE_FREQS) if ROPE_FREQS in f.tensors else None
    full_rope: dict = {"rope_type": "default", "rope_theta": _f32(md.get(A + "rope.freq_base", 1e6))}
    if freqs is not None:
        pairs = int(np.sum(np.asarray(freqs, dtype=np.float64) < 1e20))
        full_rope.update(rope_type="proportional", partial_rotary_factor=2 * pairs / global_dim)
    swa_rot = int(md.get(A + "rope.dimension_count_swa", head_dim))
    swa_rope: dict = {"rope_type": "default", "rope_theta": _f32(md.get(A + "rope.freq_base_swa", 1e4))}
    if swa_rot != head_dim:
        swa_rope["partial_rotary_factor"] = swa_rot / head_dim
    for t in ("token_embd.weight", "self_cond_gate.weight"):
        if t not in f.tensors:
            raise UserError(f"{src}: GGUF file lacks tensor {t!r}; is it a complete DiffusionGemma conversion?")
    vocab, hidden = f.tensors["token_embd.weight"].shape
    cap = float(md.get(A + "final_logit_softcapping", 0.0))
    eos = int(md.get("tokenizer.ggml.eos_token_id", 1))
    eot = md.get("tokenizer.ggml.eot_token_id")
    if eot is None:  # llama.cpp's conversions carry none: <turn|> by name, the released config.json's [1, 106]
        eot = next((i for i, t in enumerate(md.get("tokenizer.ggml.tokens") or []) if t == "<turn|>"), None)
    embd_type = f.tensors["token_embd.weight"].type
    text = {
        "model_type": "diffusion_gemma_text", "vocab_size": int(vocab), "hidden_size": int(hidden),
        "intermediate_size": int(_need(md, A + "feed_forward_length", src)),
        "moe_intermediate_size": int(_need(md, A + "expert_feed_forward_length", src)),
        "num_hidden_layers": n, "num_attention_heads": int(_need(md, A + "attention.head_count", src)),
        "num_key_value_heads": (kv_of[SLIDING] or kv_of[FULL]).pop(),
        "num_global_key_value_heads": (kv_of[FULL] or {kv[0]}).pop(),
        "head_dim": head_dim, "global_head_dim": global_dim,
        "num_experts": int(_need(md, A + "expert_count", src)), "top_k_experts": int(_need(md, A + "expert_used_count", src)),
        "rms_norm_eps": _f32(md.get(A + "attention.layer_norm_rms_epsilon", 1e-6)),
        "sliding_window": int(md.get(A + "attention.sliding_window", 1024)), "layer_types": types,
        "rope_parameters": {SLIDING: swa_rope, FULL: full_rope},
        "final_logit_softcapping": _f32(cap) if cap > 0 else None,
        "max_position_embeddings": int(md.get(A + "context_length", 262144)),
        "pad_token_id": int(md.get("tokenizer.ggml.padding_token_id", 0)),
        "bos_token_id": int(md.get("tokenizer.ggml.bos_token_id", 2)), "eos_token_id": eos,
    }
    return {"model_type": "diffusion_gemma", "text_config": text,
            "canvas_length": int(md.get("diffusion.canvas_length", 256)),
            "self_conditioning_size": int(f.tensors["self_cond_gate.weight"].shape[0]),
            "eos_token_id": [eos] + ([int(eot)] if eot is not None and int(eot) != eos else []),
            "dtype": {0: "float32", 1: "float16", 30: "bfloat16"}.get(embd_type, "bfloat16")}


def generation_dict(f: GGUFFile) -> dict:
    """The generation_config.json dict of a GGUF file: the sampler keys it has (llama.cpp's conversions carry none),
    and the stop ids: `diffusion.eos_token_ids`, else <eos>, <turn|> and <|tool_response>, looked up by name."""
    md = f.metadata
    gen: dict[str, Any] = {}
    for key, ours in (("eb_max_steps", "max_denoising_steps"), ("eb_t_min", "t_min"), ("eb_t_max", "t_max"),
                      ("eb_stability_threshold", "stability_threshold"),
                      ("eb_confidence_threshold", "confidence_threshold"), ("max_new_tokens", "max_new_tokens")):
        if "diffusion." + key in md:
            v = md["diffusion." + key]
            gen[ours] = _f32(v) if isinstance(v, float) else int(v)
    if "diffusion.eb_entropy_bound" in md:
        gen["sampler_config"] = {"_cls_name": "EntropyBoundSamplerConfig",
                                 "entropy_bound": _f32(md["diffusion.eb_entropy_bound"])}
    if "diffusion.eos_token_ids" in md:
        gen["eos_token_id"] = [int(i) for i in md["diffusion.eos_token_ids"]]
    else:
        tokens = md.get("tokenizer.ggml.tokens") or []
        index = {t: i for i, t in enumerate(tokens) if t in ("<turn|>", "<|tool_response>")}
        eos = [int(md.get("tokenizer.ggml.eos_token_id", 1))] + [index[t] for t in ("<turn|>", "<|tool_response>") if t in index]
        gen["eos_token_id"] = list(dict.fromkeys(eos))
    gen["pad_token_id"] = int(md.get("tokenizer.ggml.padding_token_id", 0))
    return gen


def load_gguf_tokenizer(path: str | Path, required: bool = True):
    """The file's ChatTokenizer; None when it has none and none is `required` (bench and sweep run without)."""
    from dgcli.text.gguf_vocab import tokenizer_from_gguf

    md = open_gguf(path).metadata
    if not required and "tokenizer.ggml.tokens" not in md:
        return None
    return tokenizer_from_gguf(md, str(path))


# ---- the model -------------------------------------------------------------------------------------

def _dense(f: GGUFFile, gname: str, dtype):
    """A F32/F16/BF16 tensor as torch over the memory map (no copy), cast (a copy) where `dtype` differs."""
    import torch

    info = f.tensors[gname]
    t = torch.from_numpy(f.array(gname))
    if info.type == 30:
        t = t.view(torch.bfloat16)
    return t if t.dtype == dtype else t.to(dtype)


def _dequantized(f: GGUFFile, gname: str, dtype):
    """A quantized tensor dequantized to `dtype`, a few MB of rows at a time (the real embedding in fp32 at
    once would be a 3 GB temporary beside its 1.5 GB bf16 result)."""
    import torch

    from dgcli.model import ggml

    info = f.tensors[gname]
    raw = torch.from_numpy(f.array(gname)).reshape(-1, f.array(gname).shape[-1])
    step = max(1, (8 << 20) // (4 * info.shape[-1]))
    for i in range(0, raw.shape[0], step):
        yield ggml.dequantize(raw[i:i + step], info.type, info.shape[-1]).to(dtype)


def _mapped_forms(f: GGUFFile, dense: list[str], kept: list[str], dtype) -> dict:
    """The tensors quantized GGUF weights are used as, none in anonymous memory: `dense` ones dequantized to
    `dtype`, `kept` ones as `ggml_cpu.Prepared` forms: Q5_0, Q8_0 and Q6_K over the file's own map, the int4 forms
    (Q4_K, Q4_0) over the mapped cache file (checkpoint/mapped.py; built at the first load: one matrix at a time)."""
    import torch

    from dgcli.checkpoint import mapped
    from dgcli.kernels import ggml_cpu

    out: dict = {}
    cached = [g for g in kept if f.tensors[g].type not in ggml_cpu.RAW]
    for g in kept:
        if g not in cached:
            out[g] = ggml_cpu.prepare(torch.from_numpy(f.array(g)), f.tensors[g].type, f.tensors[g].shape[-1], dtype)
    if not dense and not cached:
        return out
    tag = str(dtype).removeprefix("torch.")
    store = mapped.open_cache(f.path, tag)
    if store is None:
        def items():
            for g in dense:
                yield g, lambda g=g: _dequantized(f, g, dtype), dtype, f.tensors[g].shape
                f.drop_pages(g)
            for g in cached:
                info, szs, raw = f.tensors[g], [], torch.from_numpy(f.array(g))
                mats = raw.reshape(-1, *raw.shape[-2:])

                def packed(info=info, mats=mats, szs=szs):
                    for m in mats:  # one matrix at a time, as `prepare` builds a stack
                        p = ggml_cpu.prepare(m, info.type, info.shape[-1], dtype)
                        szs.append(p.sz)
                        yield p.packed
                shape = ggml_cpu.prepared_shapes(info.type, *info.shape[-2:], info.shape[:-2])
                yield g + ".packed", packed, torch.uint8, shape[0]
                yield g + ".sz", lambda szs=szs: szs, dtype, shape[1]
                f.drop_pages(g)
        try:
            store = mapped.build_cache(f.path, tag, items())
        except OSError as e:
            raise UserError(f"{f.path}: cannot write the kernels' form of its weights to "
                            f"{mapped.cache_path(f.path, tag)} ({e.strerror}); free disk space there (about the "
                            "file's size) or make the GGUF file's folder writable") from None
    for g in dense:
        out[g] = store[g]
    for g in cached:
        info = f.tensors[g]
        out[g] = ggml_cpu.Prepared("int4", info.type, info.shape[-2], info.shape[-1], store[g + ".packed"],
                                   store[g + ".sz"])
    return out


def load_gguf_model(path: str | Path, device: Any = "cpu", dtype: Any = None):
    """Build a DiffusionGemma from a GGUF file. dtype None = the embedding's stored dtype (F32/F16/BF16), or
    bfloat16 when the embedding is quantized."""
    import torch
    from torch import nn

    from dgcli.checkpoint.directory import resolve_dtype
    from dgcli.checkpoint.meta import meta_model
    from dgcli.model import ggml

    f = open_gguf(path)
    cfg = parse_config(config_dict(f), source=str(path))
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype)
    model = meta_model(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names = {k: to_gguf_name(k) for k in expected}
    split = nvfp4.gguf_split(f, names, expected, str(path))  # llama.cpp's split NVFP4 gate and up: nvfp4.py reads them
    gnames = set(names.values()).union(*split.values())
    known = gnames | {ROPE_FREQS} | nvfp4.gguf_scale_names(f, gnames)
    names = {n: g for n, g in names.items() if n not in split}
    for gname, info in f.tensors.items():
        if gname not in known:
            what = ("an untied output head; dgemma runs DiffusionGemma's tied head" if gname == "output.weight"
                    else "not a DiffusionGemma tensor this config describes")
            raise UserError(f"{path}: GGUF tensor {gname!r} is {what}")
    missing = [g for g in names.values() if g not in f.tensors]
    if missing:
        raise UserError(f"{path}: GGUF file lacks tensor {missing[0]!r}"
                        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; is the conversion complete?")
    for name, gname in names.items():
        info = f.tensors[gname]
        if info.type not in ggml.NAMES and info.type != nvfp4.GGUF_TYPE:  # those model/ggml.py, model/nvfp4.py run
            raise UserError(f"{path}: tensor {gname!r} is {info.type_name}; dgemma reads {', '.join(ggml.NAMES.values())} tensors: "
                            "use a file of those types (or make one with `dgemma quantize`)")
        if info.shape != expected[name]:
            raise UserError(f"{path}: tensor {gname!r} has shape {list(info.shape)} (GGUF order "
                            f"{list(reversed(info.shape))}); the file's metadata implies {list(expected[name])}")
    embd = f.tensors[names["embed_tokens.weight"]]
    run = dtype or {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}.get(embd.type, torch.bfloat16)
    nvfp4.gguf_modules_(f, model, names, str(path), split)  # type 40: NVFP4 modules, kept at 4 bits
    quant = {n for n, g in names.items() if f.tensors[g].type in ggml.QUANTIZED}
    experts = [i for i in range(cfg.num_hidden_layers)
               if {f"layers.{i}.experts.gate_up_proj", f"layers.{i}.experts.down_proj"} <= quant]
    for i in experts:
        quant -= {f"layers.{i}.experts.gate_up_proj", f"layers.{i}.experts.down_proj"}
    linear = {n for n in quant if n.endswith(".weight") and isinstance(model.get_submodule(n[:-7]), nn.Linear)}
    forms = _mapped_forms(f, [names[n] for n in sorted(quant - linear)],
                          [names[n] for n in sorted(linear)] + [names[f"layers.{i}.experts.{w}"] for i in experts
                                                                for w in ("gate_up_proj", "down_proj")], run)
    state: dict[str, torch.Tensor] = {}
    for i in experts:
        gu, dn = (names[f"layers.{i}.experts.{w}"] for w in ("gate_up_proj", "down_proj"))
        model.set_submodule(f"layers.{i}.experts", ggml.QuantExperts(
            forms[gu], f.tensors[gu].type, forms[dn], f.tensors[dn].type, cfg.hidden_size, cfg.moe_intermediate_size,
            dtype=run))
    for name in sorted(quant):
        if name in linear:
            sub = model.get_submodule(name[:-7])
            model.set_submodule(name[:-7], ggml.QuantLinear(forms[names[name]], f.tensors[names[name]].type,
                                                            sub.in_features, sub.out_features, dtype=run))
        else:  # the embedding (also the tied head), a router, one half of a layer's experts: run dtype
            state[name] = forms[names[name]]
    for name, gname in names.items():
        if f.tensors[gname].type not in ggml.QUANTIZED + (nvfp4.GGUF_TYPE,):
            state[name] = _dense(f, gname, run)
            if state[name].data_ptr() != f.array(gname).ctypes.data:  # cast to the run dtype: a copy
                f.drop_pages(gname)
    model.load_state_dict(state, strict=False, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise UserError(f"{path}: no weights for {left[0]!r}; the file does not describe this model")
    return model.to(device).eval()


def held_bytes(qtype: int, n: int, k: int) -> int:
    """Bytes a load holds for an [n, k] matrix of GGML type `qtype`: the kernels' prepared form (for the cost model)."""
    from dgcli.kernels import ggml_cpu

    return ggml_cpu.prepared_bytes(qtype, n, k)
