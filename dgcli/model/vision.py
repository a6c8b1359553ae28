"""The Gemma-4 vision tower and its projector (spec §1.3, §9): image patches -> soft tokens in the text width.

One image at a time, its real patches only (the reference pads and masks the padding out: the same numbers). Patch
embedding + 2-D position table, bidirectional layers with axial 2-D RoPE (x on a head's first half, y on its
second), k x k average pooling, sqrt(d) scaling and standardisation in fp32, then the projector (Norm_0, Linear).
Module names follow the checkpoint's. Must not: read files or images (checkpoint/vision.py, text/images.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dgcli.kernels import dispatch
from dgcli.model.gemma import Attention, RMSNorm


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    standardize: bool = False
    soft_tokens: int = 280  # the most soft tokens per image (the processor's max_soft_tokens)
    text_hidden_size: int = 0
    image_token_id: int = -1  # the soft tokens' placeholder id in the prompt
    bidirectional: bool = False  # use_bidirectional_attention == "vision": an image's tokens see each other


class Linear(nn.Module):
    """The checkpoint's `X.linear.weight` (a clippable linear; the released tower does not clip)."""

    def __init__(self, i: int, o: int):
        super().__init__()
        self.linear = nn.Linear(i, o, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on each half of the head: x [n, h, d]; cos, sin [n, 1, d] (per half: its coordinate)."""
    out = []
    for part, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1)):
        a, b = part.chunk(2, -1)
        out.append(part * c + torch.cat((-b, a), -1) * s)
    return torch.cat(out, -1)


class VisionLayer(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        h, d, eps = c.hidden_size, c.head_dim, c.rms_norm_eps
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj, a.k_proj = Linear(h, c.num_attention_heads * d), Linear(h, c.num_key_value_heads * d)
        a.v_proj, a.o_proj = Linear(h, c.num_key_value_heads * d), Linear(c.num_attention_heads * d, h)
        a.q_norm, a.k_norm, a.v_norm = RMSNorm(d, eps), RMSNorm(d, eps), RMSNorm(d, eps, with_scale=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = Linear(h, c.intermediate_size), Linear(h, c.intermediate_size)
        self.mlp.down_proj = Linear(c.intermediate_size, h)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.d = d

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, n = self.self_attn, x.shape[0]
        y = self.input_layernorm(x)
        q = _rope(a.q_norm(a.q_proj(y).view(n, -1, self.d)), cos, sin)
        k = _rope(a.k_norm(a.k_proj(y).view(n, -1, self.d)), cos, sin)
        v = a.v_norm(a.v_proj(y).view(n, -1, self.d))
        o = Attention.sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None)
        x = x + self.post_attention_layernorm(a.o_proj(o[0].transpose(0, 1).flatten(1)))
        m = self.mlp
        y = self.pre_feedforward_layernorm(x)
        return x + self.post_feedforward_layernorm(m.down_proj(dispatch.gelu_mul(m.gate_proj(y), m.up_proj(y))))


class VisionTower(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.c = c
        self.patch_embedder = nn.Module()
        self.patch_embedder.input_proj = nn.Linear(3 * c.patch_size ** 2, c.hidden_size, bias=False)
        self.patch_embedder.position_embedding_table = nn.Parameter(torch.ones(2, c.position_embedding_size,
                                                                               c.hidden_size))
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(c) for _ in range(c.num_hidden_layers))
        if c.standardize:
            self.register_buffer("std_bias", torch.zeros(c.hidden_size))
            self.register_buffer("std_scale", torch.ones(c.hidden_size))

    def forward(self, patches: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """patches [n, 3·p²] in [0, 1] (row-major patch grid), pos [n, 2] (x, y) -> soft tokens [n / k², H_v]."""
        c, pe = self.c, self.patch_embedder
        table = pe.position_embedding_table  # (its dtype is the tower's: the linears may be packed for the CPU)
        x = pe.input_proj((2 * (patches - 0.5)).to(table.dtype))
        x = x + (F.embedding(pos[:, 0], table[0]) + F.embedding(pos[:, 1], table[1]))
        half = c.head_dim // 2
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=x.device) / half))
        f = pos[..., None].float() * inv  # [n, 2, d/4]
        f = torch.cat((f[:, 0], f[:, 0], f[:, 1], f[:, 1]), -1)[:, None]  # [n, 1, d]
        cos, sin = f.cos().to(x.dtype), f.sin().to(x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        k = c.pooling_kernel_size
        # k x k mean of the patch grid into row-major cells, as the reference computes it (a one-hot matmul in fp32)
        cell = pos[:, 0] // k + (int(pos[:, 0].max()) + 1) // k * (pos[:, 1] // k)  # [n]
        weights = F.one_hot(cell, len(pos) // k ** 2).float() / k ** 2  # [n, n / k²]
        pooled = (weights.T[None] @ x.float()[None])[0].to(x.dtype)  # [n / k², H_v]
        out = pooled.float() * c.hidden_size ** 0.5
        if c.standardize:
            out = (out - self.std_bias.float()) * self.std_scale.float()
        return out.to(x.dtype)


class VisionEncoder(nn.Module):
    """`vision_tower` + `embed_vision` (the projector): `features(patches, pos)` -> [soft tokens, text H]."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.vision_tower = VisionTower(c)
        self.embed_vision = nn.Module()
        self.embed_vision.embedding_projection = nn.Linear(c.hidden_size, c.text_hidden_size, bias=False)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, with_scale=False)

    @torch.no_grad()
    def features(self, patches: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.embed_vision.embedding_projection(self.norm(self.vision_tower(patches, pos)))
