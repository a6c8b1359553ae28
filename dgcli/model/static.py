"""The decoder pass with static shapes: for a given batch size and key span, every step of every block runs
the same shapes and reads no host value, so a whole denoising step can be captured (CUDA graphs) or
compiled once (torch.compile).

Owns: `decode_static`. The canvas rows sit at positions lens[b].. (a device tensor) and read
cache rows `slots` (a device tensor, or None for the cache's rows in order). Full layers read the first
`span` slots of their buffer (>= every row's length; `static_step.key_span` buckets it), sliding layers their
first min(R, span) ring slots (a ring holds position p at slot p mod R: below R positions, slots < lens; from
R on, all R); the slots a row has not filled (slot >= lens[b]) are masked, and the canvas's own keys come
last. These are the reference's keys (the last W-1 prefix positions on sliding layers, the whole prefix on
full ones, then the canvas) in another order (a ring in slot order) and with masked entries among them, so
the numbers equal `DiffusionGemma.decode` up to the order of the attention's additions
(tests/model/test_static_decode.py states the bound). Rows of different lengths are one batch: no per-row
loop, no mask or table built on the host.
Must not: write the cache, or read a device value on the host.
"""

from __future__ import annotations

import torch

from dgcli.model.cache import KVCache


def _keys(buf: torch.Tensor, n: int, slots: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """[B, n_kv, n + C, d]: the first n slots of cache rows `slots` (default all, in order), then the canvas's
    own keys `new`."""
    prefix = buf[:, :, :n] if slots is None else buf[:, :, :n].index_select(0, slots)
    return torch.cat((prefix, new), dim=2)


@torch.no_grad()
def decode_static(model, canvas: torch.Tensor, cache: KVCache, soft: torch.Tensor | None, lens: torch.Tensor,
                  span: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Decoder pass over canvas [B, C] at positions lens[b].. (lens [B] int64 on the device), reading cache row
    slots[b] (default b) through `span` full-layer slots (>= max(lens)); final-normed hidden states [B, C, H]."""
    b, c = canvas.shape
    dev = canvas.device
    if span > cache.max_len:
        raise ValueError(f"span {span} > the cache's {cache.max_len} positions")
    x = model.self_conditioning.condition(model.embed(canvas), soft)
    j = torch.arange(c, device=dev)
    tables = model._tables(lens[:, None] + j, x.dtype)  # per-row positions [B, C]
    visible = torch.ones(b, c, dtype=torch.bool, device=dev)  # the canvas's own keys
    masks: dict[int | None, torch.Tensor] = {}  # by ring length (None: the full layers' span)
    for i, (layer, g) in enumerate(zip(model.layers, model.geometry)):
        r = cache.ring[i]
        n = span if r is None else min(r, span)  # a ring not yet wrapped holds rows' positions at slots < lens
        if r not in masks:  # [B, 1, 1, n + C]: slot s is filled iff s < lens[b] (a ring: all once it wrapped)
            filled = torch.arange(n, device=dev)[None, :] < lens[:, None]
            masks[r] = torch.cat((filled, visible), dim=1)[:, None, None, :]
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(x), *tables[g.kind])
        keys, values = _keys(cache.k[i], n, slots, k), _keys(cache.v[i], n, slots, v)
        x = x + layer.post_attention_layernorm(attn.attend(q, keys, values, masks[r]))
        x = layer.feed_forward(x)
        x *= layer.layer_scalar
    return model.norm(x)
