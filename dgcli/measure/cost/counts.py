"""The cost model's counts, from a `ModelConfig` alone: parameters, bytes by dtype, FLOPs and bytes per denoising
step, commit and prefill, and the roofline floor (a checkpoint's safetensors *headers*, read by checkpoint/, may give
bytes by dtype). Must not: run the model, print, load weights, or import torch.

Conventions (every figure says which it is):
* FLOPs = 2 x multiply-accumulates of the matmuls the reference ops run (projections, attention QK^T and AV over
  the (query, key) pairs the mask lets through, dense MLP, router, top-k experts, LM head, self-conditioning);
  elementwise work is left out. Useful FLOPs: a fast path that pads (grouped experts) executes more.
* Bytes = a lower bound on traffic: every weight a pass uses read once per use (the tied embedding twice a step:
  LM head and soft embedding) plus the KV cache read (and written, for a commit); activations left out. FP8 and
  NVFP4 configs read their quantized matrices as stored (`_quant_bytes`). Experts: T tokens routed to k of E touch
  E(1-(1-k/E)^T) distinct experts under uniform routing: a 256-token canvas reads almost the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dgcli.checkpoint.config import safetensors_header
from dgcli.measure.peaks import Peaks
from dgcli.model.config import LayerGeometry, ModelConfig

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "BF16": 2, "F16": 2, "F32": 4, "F64": 8,
               "I64": 8, "I32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
_ST_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
             "I32": "int32", "I8": "int8", "U8": "uint8", "F8_E4M3": "float8_e4m3", "F8_E5M2": "float8_e5m2",
             "BOOL": "bool"}
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


# ---- parameters --------------------------------------------------------------------------------------


def _attn_params(cfg: ModelConfig, g: LayerGeometry) -> int:
    h, n, d, kv = cfg.hidden_size, cfg.num_attention_heads, g.head_dim, g.num_kv_heads
    proj = h * n * d + h * kv * d * (2 if g.has_v_proj else 1) + n * d * h  # q, k, (v), o
    return proj + 2 * d  # q_norm, k_norm gains


def _expert_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size  # gate, up, down of one expert


def _router_params(cfg: ModelConfig) -> int:
    return cfg.num_experts * cfg.hidden_size + cfg.hidden_size + cfg.num_experts  # proj, scale, per_expert_scale


def _proj_rows(cfg: ModelConfig, g: LayerGeometry) -> int:
    """Output channels of one layer's q, k, (v), o projections (one quantization scale each)."""
    kv = g.num_kv_heads * g.head_dim * (2 if g.has_v_proj else 1)
    return cfg.num_attention_heads * g.head_dim + kv + cfg.hidden_size


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Text-model parameters by part, `total`, and `active_per_token` (embedding counted once, as it is
    both the input table and the tied head; top_k of num_experts experts; everything else whole)."""
    h = cfg.hidden_size
    layers = cfg.layers
    parts = {
        "embedding": cfg.vocab_size * h,
        "attention": sum(_attn_params(cfg, g) for g in layers),
        "dense_mlp": len(layers) * 3 * h * cfg.intermediate_size,
        "router": len(layers) * _router_params(cfg),
        "experts": len(layers) * cfg.num_experts * _expert_params(cfg),
        "norms": len(layers) * 7 * h + h,  # 7 gains per layer + the final norm
        "self_conditioning": h + 3 * h * cfg.self_conditioning_size,
        "layer_scalars": 2 * len(layers),  # decoder and encoder copies (fp32 in the checkpoint)
    }
    total = sum(parts.values())
    active = total - parts["experts"] + len(layers) * cfg.top_k_experts * _expert_params(cfg)
    return {**parts, "total": total, "active_per_token": active}


def quantized_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, output channels) of the matrices a quantized checkpoint stores quantized, one scale per output
    channel: attention projections, dense MLP and experts (llm-compressor's recipes); experts only (modelopt)."""
    h, layers, n = cfg.hidden_size, cfg.layers, len(cfg.layers) * cfg.num_experts
    experts = n * _expert_params(cfg), n * (2 * cfg.moe_intermediate_size + h)
    if cfg.quantization is not None and cfg.quantization.layout == "modelopt":  # NVIDIA's NVFP4 export
        return experts
    params = sum(_attn_params(cfg, g) - 2 * g.head_dim for g in layers) + len(layers) * 3 * h * cfg.intermediate_size
    rows = sum(_proj_rows(cfg, g) for g in layers) + len(layers) * (2 * cfg.intermediate_size + h)
    return params + experts[0], rows + experts[1]


def _quant_bytes(cfg: ModelConfig, weight_bytes: float) -> tuple[float, float]:
    """(bytes per quantized weight, bytes per channel scale) of cfg's quantized matrices (FP8: 1 byte + a scale in
    the checkpoint's dtype); unquantized, every weight costs weight_bytes (0: weights not counted)."""
    if cfg.quantization is None or not weight_bytes:
        return weight_bytes, 0
    if cfg.quantization.nvfp4:  # 4 bits + an e4m3 scale per 16; an fp32 global per row (as held: model/nvfp4.py)
        return 0.5 + 1 / 16, 4
    return 1, DTYPE_BYTES.get(cfg.dtype, 2)


def weights_bytes_total(cfg: ModelConfig, wb: int) -> int:
    """The weights' bytes at `wb` bytes per unquantized parameter (layer scalars fp32; FP8 matrices 1 byte + scales)."""
    n = param_counts(cfg)
    qb, sb = _quant_bytes(cfg, wb)
    q, rows = quantized_counts(cfg) if cfg.quantization is not None else (0, 0)
    return int((n["total"] - n["layer_scalars"] - q) * wb + q * qb + rows * sb + 4 * n["layer_scalars"])


def bytes_by_dtype_for(cfg: ModelConfig, dtype: str) -> dict[str, int]:
    """Weights' bytes by dtype when every tensor is `dtype` but the fp32 layer scalars and a quantized config's
    matrices (dummy and random models)."""
    n = param_counts(cfg)
    scalars = n["layer_scalars"]
    q, rows = quantized_counts(cfg) if cfg.quantization is not None else (0, 0)
    nv = q and cfg.quantization.nvfp4
    out = {dtype: (n["total"] - scalars - q + (0 if nv else rows)) * DTYPE_BYTES[dtype]}
    if nv:
        out.update({"nvfp4": q // 2, "float8_e4m3": q // 16, "float32": rows * 4})
    elif q:
        out["float8_e4m3"] = q
    out["float32"] = out.get("float32", 0) + scalars * 4
    return out


def safetensors_inventory(path: Path) -> dict:
    """Bytes and parameters by dtype of a checkpoint directory from its safetensors headers (no tensor data);
    vision tensors counted apart: text generation never loads them."""
    files = sorted(path.glob("*.safetensors"))
    text: dict[str, int] = {}
    vision: dict[str, int] = {}
    params = {"text": 0, "vision": 0}
    for f in files:
        header = safetensors_header(f)[0]
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            kind = "vision" if name.startswith(VISION_PREFIXES) else "text"
            table = vision if kind == "vision" else text
            dt = _ST_NAMES.get(meta["dtype"], meta["dtype"])
            table[dt] = table.get(dt, 0) + (end - begin)
            params[kind] += math.prod(meta["shape"])
    return {"files": len(files), "text_bytes_by_dtype": text, "vision_bytes_by_dtype": vision,
            "text_parameters": params["text"], "vision_parameters": params["vision"]}


# ---- costs -----------------------------------------------------------------------------------------------


@dataclass
class Cost:
    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


def distinct_experts(cfg: ModelConfig, tokens: int) -> float:
    """Expected distinct experts touched by `tokens` tokens under uniform top-k routing."""
    e, k = cfg.num_experts, cfg.top_k_experts
    return e * (1.0 - (1.0 - k / e) ** tokens)


def _causal_keys(start: int, t: int, window: int | None) -> int:
    """Sum over queries at positions start..start+t-1 of the keys each sees: q+1, capped at the window."""
    def upto(n: int) -> int:  # sum_{q=0}^{n-1} min(q + 1, window)
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window
    return upto(start + t) - upto(start)


def _ffn(cfg: ModelConfig, t: int, wb: int) -> Cost:
    """Dense MLP + router + top-k experts over t tokens."""
    h = cfg.hidden_size
    qb, sb = _quant_bytes(cfg, wb)
    flops = 2 * t * (3 * h * cfg.intermediate_size + h * cfg.num_experts
                     + cfg.top_k_experts * _expert_params(cfg))
    dense = 3 * h * cfg.intermediate_size * qb + (2 * cfg.intermediate_size + h) * sb
    expert = _expert_params(cfg) * qb + (2 * cfg.moe_intermediate_size + h) * sb
    weights = dense + (_router_params(cfg) + 7 * h) * wb + distinct_experts(cfg, t) * expert
    return Cost(flops, weights)


def _proj_bytes(cfg: ModelConfig, g: LayerGeometry, wb: int) -> float:
    """One layer's attention projections and q/k norm gains, in bytes."""
    qb, sb = _quant_bytes(cfg, wb)
    return (_attn_params(cfg, g) - 2 * g.head_dim) * qb + _proj_rows(cfg, g) * sb + 2 * g.head_dim * wb


def kv_row(g: LayerGeometry, kvb: int) -> int:
    return 2 * g.num_kv_heads * g.head_dim * kvb  # one position's K and V in one layer


def step_cost(cfg: ModelConfig, prefix_len: int, *, self_cond: bool = True, soft: bool = True,
              weight_bytes: int = 2, kv_bytes: int | None = None) -> Cost:
    """One denoising step (decoder pass over the canvas with `prefix_len` cached tokens, plus the vocab
    pass). `self_cond`: the self-conditioning MLP runs (every step but a block's first); `soft`: the next
    step's soft embedding is computed (every step but the step cap)."""
    kvb = weight_bytes if kv_bytes is None else kv_bytes
    c, h, v, n = cfg.canvas_length, cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    cost = Cost(0.0, c * h * weight_bytes)  # gathering the canvas' embedding rows
    for g in cfg.layers:
        proj = _attn_params(cfg, g) - 2 * g.head_dim
        visible = (prefix_len if g.window is None else min(prefix_len, g.window - 1))
        keys = visible + c
        cost += Cost(2 * c * proj + 4 * n * g.head_dim * c * keys,
                     _proj_bytes(cfg, g, weight_bytes) + visible * kv_row(g, kvb))
        cost += _ffn(cfg, c, weight_bytes)
    cost += Cost(2 * c * v * h, (v * h + h) * weight_bytes)  # tied LM head (+ final norm)
    if soft:
        cost += Cost(2 * c * v * h, v * h * weight_bytes)  # softmax(L) @ E
    if self_cond:
        cost += Cost(2 * c * 3 * h * cfg.self_conditioning_size,
                     (3 * h * cfg.self_conditioning_size + h) * weight_bytes)
    return cost


def encode_cost(cfg: ModelConfig, start: int, tokens: int, *, weight_bytes: int = 2) -> Cost:
    """One encoder pass (prefill or commit) over `tokens` tokens at positions start..: causal attention
    (sliding window on sliding layers), K/V written to the cache; the last layer's feed-forward is
    skipped because encoder outputs are only K/V (as dgemma's encoder does)."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    cost = Cost(0.0, tokens * h * weight_bytes)
    last = cfg.num_hidden_layers - 1
    for i, g in enumerate(cfg.layers):
        proj = _attn_params(cfg, g) - 2 * g.head_dim
        pairs = _causal_keys(start, tokens, g.window)
        read = start if g.window is None else min(start, g.window - 1)
        cost += Cost(2 * tokens * proj + 4 * n * g.head_dim * pairs,
                     _proj_bytes(cfg, g, weight_bytes) + (read + tokens) * kv_row(g, weight_bytes))
        if i != last:
            cost += _ffn(cfg, tokens, weight_bytes)
    return cost


def block_cost(cfg: ModelConfig, prefix_len: int, steps: int, max_steps: int, **kw) -> Cost:
    """All denoising steps of one block that ran `steps` of at most `max_steps` steps, exactly as the
    sampler runs them: no self-conditioning on the first step, no soft embedding on the step cap."""
    total = Cost()
    for i in range(steps):
        total += step_cost(cfg, prefix_len, self_cond=i > 0, soft=i < max_steps - 1, **kw)
    return total


# ---- devices -------------------------------------------------------------------------------------------


def floor_seconds(cost: Cost, peaks: Peaks) -> tuple[float, str]:
    """Roofline floor: the larger of compute time and memory time at the device's peaks, and which bound."""
    compute, memory = cost.flops / peaks.flops_per_s, cost.bytes / peaks.bytes_per_s
    return (compute, "compute") if compute >= memory else (memory, "memory")
