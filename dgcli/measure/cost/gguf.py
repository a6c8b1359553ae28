"""`dgemma info FILE.gguf`: a GGUF file's bytes by ggml type (from its header alone), the weights a load keeps,
whether a run fits this machine's memory, what the low-memory mode needs, and the step time a memory cap implies
(the weights that do not fit read from disk every step); its markdown lines. Must not: read tensor data or load
the model.
"""

from __future__ import annotations

import math
from pathlib import Path

from dgcli.measure.cost.counts import DTYPE_BYTES
from dgcli.measure.cost.memory import kv_bytes, one_request, size
from dgcli.model.config import ModelConfig


def gguf_inventory(path: Path) -> dict:
    """Bytes and parameters by ggml type of a GGUF file, from its header only (the `safetensors_inventory`
    keys, plus per tensor what a load keeps: quantized matrices in the kernels' held form, the rest in the run dtype)."""
    from dgcli.checkpoint.gguf import open_gguf
    from dgcli.checkpoint.gguf_model import held_bytes
    from dgcli.model import ggml

    f = open_gguf(path)
    by_type: dict[str, int] = {}
    params, kept_quantized, dense_elements = 0, 0, 0
    layers = [0] * int(f.metadata.get("diffusion-gemma.block_count", 0))
    for t in f.tensors.values():
        n = math.prod(t.shape)
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
        params += n
        # The embedding (the tied head) and a router are dequantized at load; other quantized matrices stay.
        if t.type in ggml.QUANTIZED and t.name != "token_embd.weight" and ".ffn_gate_inp." not in t.name:
            kept = math.prod(t.shape[:-2]) * held_bytes(t.type, *t.shape[-2:]) if len(t.shape) > 1 else t.nbytes
        elif t.type == 40:  # NVFP4: held at 4 bits + an e4m3 scale per 16 (as stored) + an fp32 global per row
            kept = t.nbytes + 4 * math.prod(t.shape[:-1])
        else:
            dense_elements += n if t.name != "rope_freqs.weight" else 0
            continue
        kept_quantized += kept
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) < len(layers):
            layers[int(t.name.split(".")[1])] += kept
    return {"files": 1, "text_bytes_by_dtype": by_type, "vision_bytes_by_dtype": {}, "text_parameters": params,
            "vision_parameters": 0, "file_bytes": path.stat().st_size, "quantized_bytes_kept": kept_quantized,
            "dense_elements": dense_elements, "layer_bytes": layers}


def gguf_fit(inventory: dict, cfg: ModelConfig, dtype: str, context: int, ram_bytes: int,
             available_bytes: int | None, caps: list[int] = (), read_rate: float | None = None) -> dict:
    """Whether a GGUF model (weights as loaded + KV for `context` tokens + one request's passes) fits the memory
    available now and the machine's RAM; what the low-memory mode needs (all but the layers, and two layers: the one
    computing, the next read ahead); per memory cap in `caps` the weights read from disk each step (the layers
    beyond those that stay, as session.low_memory_mode keeps them) and at `read_rate` the least step time."""
    wb = DTYPE_BYTES[dtype]
    weights = inventory["quantized_bytes_kept"] + inventory["dense_elements"] * wb
    work = kv_bytes(cfg, context, wb)["total"] + one_request(cfg, context, ab=wb)["cpu"]
    need = weights + work
    layers = inventory.get("layer_bytes") or [0]
    resident = weights - sum(layers)  # the embedding (the head reads it every step), norms, routers
    low = work + resident + 2 * max(layers)
    out = {"weights_loaded": weights, "need": need, "need_low_memory": low, "ram": ram_bytes,
           "available": available_bytes, "fits_ram": need <= ram_bytes,
           "fits_available": None if available_bytes is None else need <= available_bytes, "read_rate": read_rate,
           "caps": []}
    for cap in caps:
        room, kept = 0.9 * cap - work - resident - (1 << 29), 0
        for b in layers:
            if kept + b > room:
                break
            kept += b
        read = sum(layers) - kept
        out["caps"].append({"cap": cap, "fits": low <= cap, "read_per_step": read,
                            "step_s": None if read_rate is None else read / read_rate})
    return out


def gguf_section(card: dict, inventory: dict, cfg: ModelConfig, dtype: str, context: int, *, ram: int,
                 available: int | None, memory_gib: float | None, cap: int | None, read_rate: float | None) -> str:
    """`dgemma info FILE.gguf`: the card's weights as a load holds them, `card["gguf"]` what fits (`gguf_fit`, under
    --memory, else this process's memory `cap`, else 16 and 8 GiB); returns its markdown: bytes by type, what fits."""
    caps = [int(memory_gib * 2**30)] if memory_gib else [cap] if cap else [16 << 30, 8 << 30]
    fit = gguf_fit(inventory, cfg, dtype, context, ram, available, caps, read_rate)
    mem = card["memory"]
    mem["total"] = {path: t - mem["weights"] + fit["weights_loaded"] for path, t in mem["total"].items()}
    mem["weights"] = fit["weights_loaded"]
    card["gguf"], card["bytes_source"] = fit, "GGUF header (by ggml type)"
    by_type = sorted(inventory["text_bytes_by_dtype"].items(), key=lambda kv: -kv[1])
    types = ", ".join(f"{k} {size(v)}" for k, v in by_type)
    avail = fit["available"]
    fits = fit["fits_available"] if avail is not None else fit["fits_ram"]
    return (f"\n## GGUF file\n\n- file: {size(inventory['file_bytes'])}; tensors by type: {types}\n"
            f"- weights as loaded: {size(fit['weights_loaded'])} (quantized matrices stay quantized; the embedding, "
            "norms and router in the run dtype)\n"
            f"- to run (weights + KV cache + step working set): {size(fit['need'])}; this machine has "
            f"{size(fit['ram'])} of memory" + (f", {size(avail)} available now" if avail is not None else "")
            + f": it {'fits' if fits else 'does NOT fit'}\n"
            f"- in low-memory mode (--low-memory: the weights paged from the file, the layers that do not fit read "
            f"from disk each step): {size(fit['need_low_memory'])}\n" + "".join(
                f"- under a {size(c['cap'])} memory cap: "
                + ("too little even in low-memory mode" if not c["fits"] else
                   f"{size(c['read_per_step'])} of weights read from disk a step"
                   + (f", at least {c['step_s']:.1f} s a step at {fit['read_rate'] / 1e6:.0f} MB/s"
                      if c["step_s"] is not None else "")) + "\n" for c in fit["caps"]))
