"""The card: the one dict `dgemma info` prints and `dgemma bench` puts first, from the cost model's counts, its
memory and a device's peaks. Must not: run the model, print, load weights, or import torch.
"""

from __future__ import annotations

from dataclasses import asdict

from dgcli.measure.cost.counts import (DTYPE_BYTES, bytes_by_dtype_for, distinct_experts, encode_cost, floor_seconds,
                                       param_counts, step_cost, weights_bytes_total)
from dgcli.measure.cost.memory import GPUS, batch_memory, kv_bytes, one_request
from dgcli.measure.peaks import Peaks
from dgcli.model.config import FULL, ModelConfig


def layer_pattern(cfg: ModelConfig) -> str:
    full = [i for i, t in enumerate(cfg.layer_types) if t == FULL]
    return f"{cfg.num_hidden_layers} layers: {len(full)} full-attention at {full}, the rest sliding ({cfg.sliding_window})"


def image_cost(cfg: ModelConfig, parameters: int) -> dict:
    """The vision tower's parameters and one largest image: its soft tokens (prompt positions) and the tower's FLOPs
    (2 x MACs of its matmuls over soft_tokens x k² patches, attention included)."""
    v = cfg.raw.get("vision_config") or {}
    soft, k = int(cfg.raw.get("vision_soft_tokens_per_image", 280)), int(v.get("pooling_kernel_size", 3))
    n, h, layers = soft * k * k, int(v.get("hidden_size", 0)), int(v.get("num_hidden_layers", 0))
    attn = 4 * n * n * int(v.get("num_attention_heads", 0)) * int(v.get("head_dim", 0)) * layers
    return {"parameters": parameters, "tokens_per_image": soft, "flops_per_image": 2 * n * parameters + attn}


def card(cfg: ModelConfig, *, name: str, source: str, dtype: str, context: int = 4096, prompt_len: int = 256,
         peaks: list[Peaks] = (), inventory: dict | None = None, threads: tuple[int, str] | None = None,
         budgets: list[dict] | None = None, headroom: float = 0.10, held: dict | None = None) -> dict:
    """Everything `dgemma info` shows, as one JSON-ready dict. `dtype`: the run dtype of weights and KV;
    `inventory` (`safetensors_inventory`): a real checkpoint's stored bytes; `threads`: (count, source) of the
    thread rule; `budgets` (`batch_memory`'s; default the H100 and H200) with `headroom` of each left free;
    `held` (bytes by dtype of a loaded model's own tensors, GGML blocks as held) replaces the config's weights."""
    if budgets is None:
        budgets = [{"name": n, "bytes": b, "cpu": False} for n, b in GPUS]
    wb = DTYPE_BYTES[dtype]
    counts = param_counts(cfg)
    weights = sum(held.values()) if held else weights_bytes_total(cfg, wb)
    vision = image_cost(cfg, inventory["vision_parameters"]) if inventory and inventory["vision_parameters"] else None
    if vision is not None:  # the tower loads with the model, in its dtype
        weights += vision["parameters"] * wb
    step = step_cost(cfg, prompt_len, weight_bytes=wb)
    first, last = (step_cost(cfg, prompt_len, self_cond=False, weight_bytes=wb),
                   step_cost(cfg, prompt_len, soft=False, weight_bytes=wb))
    commit = encode_cost(cfg, prompt_len, cfg.canvas_length, weight_bytes=wb)
    prefill = encode_cost(cfg, 0, prompt_len, weight_bytes=wb)
    extra = one_request(cfg, context, prompt_len, wb)  # sampler state, a pass's temporaries
    kv = kv_bytes(cfg, context, wb)  # what dgemma's cache holds (sliding rings)
    devices = []
    for p in peaks:
        s, bound = floor_seconds(step, p)
        cs, cbound = floor_seconds(commit, p)
        devices.append({**asdict(p), "floor_step_ms": s * 1e3, "floor_step_bound": bound,
                        "floor_commit_ms": cs * 1e3, "floor_commit_bound": cbound,
                        "ceiling_canvas_tokens_per_s": cfg.canvas_length / s})
    stored = held or (inventory["text_bytes_by_dtype"] if inventory else bytes_by_dtype_for(cfg, dtype))
    return {
        "model": name,
        "source": source,
        "dtype": dtype,
        "weights": weights_line(cfg, dtype),
        "config": {
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "layers": layer_pattern(cfg),
            "attention_heads": cfg.num_attention_heads,
            "kv_heads": {"sliding": cfg.num_key_value_heads, "full": cfg.num_global_key_value_heads},
            "head_dim": {"sliding": cfg.head_dim, "full": cfg.global_head_dim},
            "dense_mlp": cfg.intermediate_size,
            "experts": f"{cfg.top_k_experts} of {cfg.num_experts} (width {cfg.moe_intermediate_size})",
            "canvas_length": cfg.canvas_length, "max_position_embeddings": cfg.max_position_embeddings,
        },
        "parameters": counts,
        "bytes_by_dtype": stored,
        "bytes_source": ("the loaded model's tensors (quantized blocks as held)" if held else
                         "safetensors headers (text tensors)" if inventory else f"config x {dtype} (layer scalars fp32)"),
        "vision": vision and {**vision, "bytes_by_dtype": inventory["vision_bytes_by_dtype"],
                              "note": f"loaded with the model (in its weights): an image is at most "
                                      f"{vision['tokens_per_image']} prompt tokens and "
                                      f"~{vision['flops_per_image']:.3g} FLOPs of the tower"},
        "memory": {
            "weights": weights, "kv_context": context, "kv_cache": kv["total"],
            "kv_per_token": kv["was_per_token"],  # every layer's K/V of one position
            "kv_cache_every_position": context * kv["was_per_token"],
            "one_request": extra, "total": {path: weights + kv["total"] + x for path, x in extra.items()},
        },
        "batch_memory": batch_memory(cfg, context=context, prompt_len=prompt_len, dtype=dtype,
                                     budgets=budgets, headroom=headroom),
        "prompt_len": prompt_len,
        "per_step": {"flops": step.flops, "bytes": step.bytes, "first_step_flops": first.flops,
                     "last_step_flops": last.flops, "distinct_experts": distinct_experts(cfg, cfg.canvas_length)},
        "per_commit": {"flops": commit.flops, "bytes": commit.bytes},
        "prefill": {"flops": prefill.flops, "bytes": prefill.bytes},
        "devices": devices,
        "threads": {"count": threads[0], "source": threads[1]} if threads else None,
        "conventions": ("FLOPs: 2 x MACs of matmuls (unmasked attention pairs only); bytes: each weight read "
                        "once per use + KV cache traffic, activations excluded; experts: expected distinct "
                        "experts under uniform routing. Per step = a middle step (self-conditioning and soft "
                        f"embedding on) with {prompt_len} cached tokens."),
    }


def weights_line(cfg: ModelConfig, dtype: str) -> str:
    """What the card says the weights are: the dtype, or the quantized format and what runs."""
    q = cfg.quantization
    if q is None:
        return dtype
    if q.nvfp4:
        what = "expert" if q.layout == "modelopt" else "attention, MLP and expert"
        return (f"nvfp4 ({q.scheme}, {q.layout}: e2m1 {what} matrices + e4m3 scales per 16, kept at 4 bits; activations "
                f"never FP4: in {dtype} (W4A16), int8 on a CPU with AVX-512 VNNI (W4A8); the rest {dtype})")
    return f"fp8 ({q.scheme}: e4m3 attention, MLP and expert matrices + per-channel scales; the rest {dtype})"
