"""`dgemma info FILE.gguf`: a GGUF file's bytes by ggml type (from its header alone), the weights a load keeps
(quantized matrices as stored, the rest in the run dtype), and whether a run fits this machine's memory.

Owns: that arithmetic and its markdown lines. Must not: read tensor data or load the model (counts.py does the
config-based arithmetic this builds on).
"""

from __future__ import annotations

import math
from pathlib import Path

from dgcli.measure.cost.counts import DTYPE_BYTES, kv_cache_bytes
from dgcli.measure.cost.memory import one_request
from dgcli.model.config import ModelConfig


def gguf_inventory(path: Path) -> dict:
    """Bytes and parameters by ggml type of a GGUF file, from its header only (the `safetensors_inventory`
    keys, plus per tensor what a load keeps: quantized matrices as stored, the rest in the run dtype)."""
    from dgcli.model import ggml
    from dgcli.checkpoint.gguf import open_gguf

    f = open_gguf(path)
    by_type: dict[str, int] = {}
    params, kept_quantized, dense_elements = 0, 0, 0
    for t in f.tensors.values():
        n = math.prod(t.shape)
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
        params += n
        # The embedding (the tied head) and a router are dequantized at load; other quantized matrices stay.
        if t.type in ggml.QUANTIZED and t.name != "token_embd.weight" and ".ffn_gate_inp." not in t.name:
            kept_quantized += t.nbytes
        elif t.type == 40:  # NVFP4: held at 4 bits + an e4m3 scale per 16 (as stored) + an fp32 global per row
            kept_quantized += t.nbytes + 4 * math.prod(t.shape[:-1])
        elif t.name != "rope_freqs.weight":
            dense_elements += n
    return {"files": 1, "text_bytes_by_dtype": by_type, "vision_bytes_by_dtype": {}, "text_parameters": params,
            "vision_parameters": 0, "file_bytes": path.stat().st_size, "quantized_bytes_kept": kept_quantized,
            "dense_elements": dense_elements}


def gguf_fit(inventory: dict, cfg: ModelConfig, dtype: str, context: int, ram_bytes: int,
             available_bytes: int | None) -> dict:
    """Whether a GGUF model runs in this machine's memory: weights as loaded (quantized matrices as stored,
    the rest in `dtype`) + the KV cache for `context` tokens + one request's passes (`memory.one_request`), against the memory
    available now (MemAvailable) and the machine's RAM."""
    wb = DTYPE_BYTES[dtype]
    weights = inventory["quantized_bytes_kept"] + inventory["dense_elements"] * wb
    need = weights + kv_cache_bytes(cfg, context, wb, trimmed=True) + one_request(cfg, context, ab=wb)["cpu"]
    return {"weights_loaded": weights, "need": need, "ram": ram_bytes, "available": available_bytes,
            "fits_ram": need <= ram_bytes,
            "fits_available": None if available_bytes is None else need <= available_bytes}


def _size(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def gguf_markdown(inventory: dict, fit: dict) -> str:
    """The GGUF lines of `dgemma info`: bytes by type, and what fits."""
    types = ", ".join(f"{k} {_size(v)}" for k, v in sorted(inventory["text_bytes_by_dtype"].items(), key=lambda kv: -kv[1]))
    avail = fit["available"]
    fits = fit["fits_available"] if avail is not None else fit["fits_ram"]
    return (f"\n## GGUF file\n\n- file: {_size(inventory['file_bytes'])}; tensors by type: {types}\n"
            f"- weights as loaded: {_size(fit['weights_loaded'])} (quantized matrices stay quantized; the embedding, "
            "norms and router in the run dtype)\n"
            f"- to run (weights + KV cache + step working set): {_size(fit['need'])}; this machine has "
            f"{_size(fit['ram'])} of memory" + (f", {_size(avail)} available now" if avail is not None else "")
            + f": it {'fits' if fits else 'does NOT fit'}\n")
