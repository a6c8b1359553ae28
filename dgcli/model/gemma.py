"""DiffusionGemma text model: one Gemma-4 MoE backbone run in two modes (spec §5, §6), with one layer loop.

Encoder mode (prompt chunks, block commits): scaled embeddings, causal attention (sliding window on sliding
layers), their K/V kept in the cache, encoder layer scalars. Decoder mode (the canvas): RMS-normed embeddings
plus self-conditioning, bidirectional over the canvas, the full prefix on full layers and the last W-1 prefix
positions on sliding layers, decoder layer scalars. `forward_pass` runs rows of both modes in one pass over the
cache (model/attention.py); `unified_hidden` is the same loop cache-free, with autograd (training).

Owns: the math. Must not: read files, print, tokenise, time, or sample. Module names follow the checkpoint's.
Numerics follow the transformers reference op for op (norms in fp32, router softmax fp32, RoPE tables cast to the
activation dtype, logits softcapped in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgcli.kernels import dispatch, transfer
from dgcli.model.attention import PassLayout, Segment, attend
from dgcli.model.config import LayerGeometry, ModelConfig
from dgcli.engine.kv_cache import PagedKVCache
from dgcli.engine.request import image_spans


class RMSNorm(nn.Module):
    """x·(mean(x²)+eps)^-½ in fp32, times the stored gain (no +1 offset); `with_scale=False` is Norm_0."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps, self.weight = eps, (nn.Parameter(torch.ones(dim)) if with_scale else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rms_norm(x, self.weight, self.eps)

    def add(self, residual: torch.Tensor, x: torch.Tensor, pre_add: torch.Tensor | None = None,
            scale: torch.Tensor | None = None) -> torch.Tensor:
        """(residual + self(x [+ pre_add])) [· scale], each op rounded to x.dtype (dispatch.rms_norm_add)."""
        return dispatch.rms_norm_add(x, self.weight, self.eps, residual=residual, pre_add=pre_add, scale=scale)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin [..., T, 1, d] for rotate-half RoPE (`apply_rope`) at positions [..., T]; computed in
    fp32, cast to the activation dtype as the reference does. The sin's first half is negated: the sign lives there."""
    freqs = positions.float()[..., None, None] * inv_freq  # [..., T, 1, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin, half = emb.sin().to(dtype), inv_freq.shape[-1]
    return emb.cos().to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, T, n, d]; pairs (j, j + d/2), not interleaved. The reference's x·cos + cat(-x2, x1)·sin, bit for bit:
    # cat(x2, x1)·(signed sin) differs only by where the sign flips, and a sign flip is exact.
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def inv_freq_for(g: LayerGeometry, device=None) -> torch.Tensor:
    r = g.rope
    # Same expression as the reference (fp32 pow), zero-padded beyond the rotating pairs (proportional RoPE).
    rot = 1.0 / (r.theta ** (torch.arange(0, 2 * r.rotary_pairs, 2, dtype=torch.int64).float() / r.head_dim))
    pad = torch.zeros(r.head_dim // 2 - r.rotary_pairs)
    return transfer.to_device(torch.cat((rot, pad)), torch.float32, device if device is not None else "cpu")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, g: LayerGeometry):
        super().__init__()
        self.g = g
        h, n, d = cfg.hidden_size, cfg.num_attention_heads, g.head_dim
        self.q_proj = nn.Linear(h, n * d, bias=False)
        self.k_proj = nn.Linear(h, g.num_kv_heads * d, bias=False)
        # Full layers have no v_proj: V is the raw K projection (K = V), normalised without gain.
        self.v_proj = nn.Linear(h, g.num_kv_heads * d, bias=False) if g.has_v_proj else None
        self.o_proj = nn.Linear(n * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(d, cfg.rms_norm_eps, with_scale=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, n, T, d], k and v [B, n_kv, T, d] for the tokens of this pass (fused: one GEMM, one kernel)."""
        (b, t, _), d = x.shape, self.g.head_dim
        if _fused(self, x):
            heads = (self.q_proj.out_features // d, self.k_proj.out_features // d, self.v_proj is not None)
            q, k, v = dispatch.qkv_norm_rope(F.linear(x, self.fused), self.q_norm.weight, self.k_norm.weight, cos,
                                             sin, *heads, self.q_norm.eps)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, t, -1, d)), cos, sin)
        k_raw = self.k_proj(x).view(b, t, -1, d)
        v_raw = self.v_proj(x).view(b, t, -1, d) if self.v_proj is not None else k_raw
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = self.v_norm(v_raw)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def sdpa(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        # Scale 1.0 (QK-norm absorbs 1/sqrt(d)); no attention softcap; GQA by kv-head groups.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """[B, n, T, d] attention output -> [B, T, H]."""
        return self.o_proj(o.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """Dense gated-GELU(tanh) MLP; also the self-conditioning MLP's shape."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(self, x):
            return self.down_proj(dispatch.gelu_mul_fused(F.linear(x, self.fused), self.gate_proj.out_features))
        return self.down_proj(dispatch.gelu_mul(self.gate_proj(x), self.up_proj(x)))


def _fused(m: nn.Module, x: torch.Tensor) -> bool:
    """Whether m runs its fused projection (`fuse_projections`): made, on x's device, and no autograd."""
    w = m.__dict__.get("fused")
    return w is not None and w.device == x.device and not torch.is_grad_enabled()


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.top_k, self.root = cfg.top_k_experts, cfg.hidden_size ** -0.5

    def forward(self, r: torch.Tensor):
        """r [N, H] (the un-normed residual) -> weights [N, k] fp32, expert ids [N, k]."""
        z = dispatch.router_input(r, self.scale, self.root, self.norm.eps)  # Norm_0(r)·scale·root
        # softmax over all experts in fp32, top-k renormalised, then scaled per expert
        return dispatch.route(self.proj(z), self.per_expert_scale, self.top_k)


class Experts(nn.Module):
    """Fused expert weights as stored: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, H], routing weights w [N, k] fp32, expert ids idx [N, k] -> [N, H]."""
        return dispatch.experts(x, w, idx, self.gate_up_proj, self.down_proj)


class DecoderLayer(nn.Module):
    """One backbone layer; the same weights serve both modes, only the layer scalar differs."""

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        g = cfg.layer(i)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg, g)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
        self.router = Router(cfg)
        self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.experts = Experts(cfg)
        self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        # Buffers, likely fp32 in the checkpoint: decoder-mode and encoder-mode residual scales.
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def feed_forward(self, r: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(r)))
        flat = r.reshape(-1, r.shape[-1])
        w, idx = self.router(flat)  # routes on the un-normed residual
        moe = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx).reshape(r.shape)
        moe = self.post_feedforward_layernorm_2(moe)
        return self.post_feedforward_layernorm.add(r, dense, moe, scale)  # (r + norm(dense + moe))·scale


class SelfConditioning(MLP):
    """Gated MLP over the previous step's soft embedding, added to the canvas embedding, then Norm_0."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.self_conditioning_size)
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)

    def condition(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        # soft = None is the zero soft embedding: Norm_w(0) = 0, so the MLP would add exactly 0.
        if soft is not None:
            embeds = embeds + super().forward(self.pre_norm(soft))
        return self.post_norm(embeds)


class DiffusionGemma(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)
        self.geometry, self.layer_kinds = cfg.layers, sorted(set(cfg.layer_types))
        self._inv_freq: dict[str, torch.Tensor] = {}
        self.vision = None  # the checkpoint's vision tower + projector (model/vision.py), when it has one

    # ---- small helpers -------------------------------------------------------------------------
    @property
    def embed_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight  # [V, H], also the tied LM head

    @property
    def embed_scale(self) -> torch.Tensor:
        # sqrt(H) rounded to the weight dtype as the reference rounds it; made once, by a fill (no copy that waits)
        w, got = self.embed_tokens.weight, self.__dict__.get("_embed_scale")
        if got is None or (got.device, got.dtype) != (w.device, w.dtype):
            with torch.inference_mode(False):  # a normal tensor: training multiplies by it too
                v = torch.tensor(self.config.embed_scale).to(w.dtype).item()
                self.__dict__["_embed_scale"] = got = torch.full((), v, dtype=w.dtype, device=w.device)
        return got

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple]:
        out = {}
        for kind in self.layer_kinds:
            g = next(g for g in self.geometry if g.kind == kind)
            key = f"{kind}:{positions.device}"
            if key not in self._inv_freq:
                self._inv_freq[key] = inv_freq_for(g, positions.device)
            out[kind] = rope_tables(positions, self._inv_freq[key], dtype)
        return out

    def new_cache(self, seqs: int, max_len: int, block_size: int = 16, prefix_caching: bool = False,
                  pass_rows: int | None = None) -> PagedKVCache:
        """A paged cache for `seqs` sequences of up to `max_len` positions (a canvas's own included: full layers
        hold it where its block will commit); `prefix_caching`: blocks shareable across sequences, `pass_rows`:
        the most causal rows a pass writes (engine/block_manager.py)."""
        w = self.embed_tokens.weight
        return PagedKVCache([(g.num_kv_heads, g.head_dim, g.window) for g in self.geometry], seqs=seqs,
                            max_len=max_len, device=w.device, dtype=w.dtype, block_size=block_size,
                            prefix_caching=prefix_caching, pass_rows=pass_rows)

    def pass_graphs(self, cache: PagedKVCache, dummy_seq: int, slots: int, *, capture: bool):
        """CUDA graphs of decode-only passes over `cache` (model/graphs.py)."""
        from dgcli.model.graphs import PassGraphs

        return PassGraphs(self, cache, dummy_seq, slots, capture=capture)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids) * self.embed_scale

    def soft_embedding(self, sc_logits: torch.Tensor) -> torch.Tensor:
        """Self-conditioning soft embedding softmax(L)·E·s of given (already tempered) logits [B, C, V]."""
        w = self.embed_tokens.weight
        p = torch.softmax(sc_logits, dim=-1, dtype=torch.float32).to(w.dtype)
        return torch.matmul(p, w) * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied head + softcap, float32 [B, C, V]; call it on canvas rows only."""
        out = F.linear(hidden, self.embed_tokens.weight).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    # ---- the pass -------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_pass(self, ids: torch.Tensor, segments: list, cache: PagedKVCache,
                     soft: torch.Tensor | None = None, images: tuple | None = None) -> torch.Tensor | None:
        """One pass over every row of a plan: `segments` (seq, start, length, canvas) in row order, causal ones
        (prompt chunks, committed blocks: encoder mode) before canvas ones (decoder mode, each C rows); ids [N];
        soft [B, C, H] the canvases' self-conditioning input (None: none). Writes every row's K/V into `cache`;
        returns the canvas rows' final-normed hidden states [B, C, H] (None without canvas rows). `images` (rows
        [M], features [M, H]): image soft tokens replacing those causal rows' embeddings (the reference's
        placeholder scatter); segments' `spans` are their image spans, bidirectional."""
        layout = PassLayout([Segment(s.seq, s.start, s.length, s.canvas, getattr(s, "spans", ()))
                             for s in segments], cache, ids.device)
        return self.forward_layout(ids, layout, soft, images)

    def forward_layout(self, ids: torch.Tensor, layout: PassLayout, soft: torch.Tensor | None,
                       images: tuple | None = None) -> torch.Tensor | None:
        """`forward_pass` over a built layout (a CUDA graph captures this with static inputs: model/graphs.py)."""
        nc, canvases = layout.n_causal, [s for s in layout.segments if s.canvas]
        parts = [self.embed(ids[:nc])] if nc else []
        if images is not None:
            parts[0].index_copy_(0, images[0], images[1].to(parts[0].dtype))
        if canvases:
            b, c = len(canvases), canvases[0].length
            x = self.self_conditioning.condition(self.embed(ids[nc:].view(b, c)), soft)  # [B, C, H]
            parts.append(x.flatten(0, 1))
        box = [(torch.cat(parts) if len(parts) > 1 else parts[0])[None]]  # [1, N, H] (`parts` stays: the cost model
        # in measure/cost/memory.py counts the pieces alive through the pass)
        tables = self._tables(layout.positions, box[0].dtype)  # [N, d] per layer kind
        x = self._layers(box, nc, tables, lambda i, g, q, k, v: attend(q, k, v, i, layout), cache_pass=True)
        return None if x is None else x.view(b, c, -1)

    def _layers(self, box: list, nc: int, tables: dict, attend_fn, cache_pass: bool) -> torch.Tensor | None:
        """The one layer loop, final norm included, over box's one tensor x [B, T, H] (popped: nothing holds the input
        after the first layer): its first `nc` rows causal (encoder mode), the rest canvases (decoder mode);
        `attend_fn(i, g, q, k, v)` is layer i's attention. `cache_pass` (no autograd): the last layer's feed-forward
        runs on canvas rows only (causal outputs are only ever K/V), None without canvas rows."""
        x = box.pop()
        last = len(self.layers) - 1
        for i, (layer, g) in enumerate(zip(self.layers, self.geometry)):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), *tables[g.kind])
            x = layer.post_attention_layernorm.add(x, attn.out(attend_fn(i, g, q, k, v)))
            if i == last and cache_pass:
                if nc == x.shape[1]:
                    return None
                x, nc = x[:, nc:], 0
            x = layer.feed_forward(x, layer.layer_scalar if cache_pass and not nc else None)  # in place: no graph
            if not nc:  # canvas rows only
                x = x if cache_pass else (x * layer.layer_scalar).to(x.dtype)
                continue
            if cache_pass:  # in place: no graph to keep
                x[:, :nc] *= layer.encoder_layer_scalar
                if nc < x.shape[1]:
                    x[:, nc:] *= layer.layer_scalar
            else:
                x = torch.cat((x[:, :nc] * layer.encoder_layer_scalar, x[:, nc:] * layer.layer_scalar), 1).to(x.dtype)
        return self.norm(x)

    @torch.no_grad()
    def forward_canvas(self, prompt_ids: torch.Tensor, canvas_ids: torch.Tensor,
                       self_conditioning_logits: torch.Tensor | None = None, image_features: torch.Tensor | None = None,
                       image_id: int | None = None) -> torch.Tensor:
        """float32 logits [B, C, V], meaning exactly DiffusionGemmaForBlockDiffusion(input_ids=prompt_ids,
        decoder_input_ids=canvas_ids, self_conditioning_logits=..., pixel_values=...).logits: one pass of the
        prompts' rows and the canvases' rows together. `image_features` [M, H]: the soft tokens of the prompts'
        `image_id` placeholders, in order (`vision.features` of each image, concatenated)."""
        (b, p), c = prompt_ids.shape, canvas_ids.shape[1]
        cache = self.new_cache(b, p + c)
        for seq in range(b):
            cache.reserve(seq, p + c)
        two_way = image_features is not None and self.vision is not None and self.vision.config.bidirectional
        spans = [image_spans(row.tolist(), image_id) if two_way else () for row in prompt_ids]
        segments = [Segment(seq, 0, p, False, spans[seq]) for seq in range(b)]
        segments += [Segment(seq, p, c, True) for seq in range(b)]
        soft = None if self_conditioning_logits is None else self.soft_embedding(self_conditioning_logits)
        ids = torch.cat((prompt_ids.flatten(), canvas_ids.flatten()))
        images = None
        if image_features is not None:
            images = ((prompt_ids.flatten() == image_id).nonzero()[:, 0], image_features)
        return self.logits(self.forward_pass(ids, segments, cache, soft, images))

    def unified_hidden(self, prompt_ids: torch.Tensor, canvas_ids: torch.Tensor, soft: torch.Tensor | None = None,
                       prefix_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer loop without a cache, differentiable, over [prefix | canvas] (spec §5.6 'unified' formulation):
        final-normed hidden states (prefix [B, P, H], canvas [B, C, H]). `prefix_valid` [B, P] (True = real token)
        hides padding keys, for training batches of unequal prompts."""
        p, c = prompt_ids.shape[1], canvas_ids.shape[1]
        box = [torch.cat((self.embed(prompt_ids), self.self_conditioning.condition(self.embed(canvas_ids), soft)), 1)]
        pos = torch.arange(p + c, device=prompt_ids.device)
        tables = self._tables(pos, box[0].dtype)
        qp, kp = pos[:, None], pos[None, :]
        q_prefix, k_prefix = qp < p, kp < p
        valid = None
        if prefix_valid is not None:  # [B, 1, 1, P + C]: padding keys invisible to every row
            valid = torch.cat((prefix_valid, prefix_valid.new_ones(prefix_valid.shape[0], c)), dim=1)[:, None, None, :]

        def masked(i, g, q, k, v):
            w = g.window
            causal = k_prefix & (kp <= qp) & ((kp > qp - w) if w else True)
            canvas_rows = ~q_prefix & (~k_prefix | ((kp >= p - (w - 1)) if w else True))
            mask = torch.where(q_prefix, causal, canvas_rows)
            if valid is not None:
                # Keep each row's own key visible so fully padded rows still have a finite softmax.
                mask = (mask & valid) | torch.eye(p + c, dtype=torch.bool, device=pos.device)
            return Attention.sdpa(q, k, v, mask)

        x = self._layers(box, p, tables, masked, cache_pass=False)
        return x[:, :p], x[:, p:]
