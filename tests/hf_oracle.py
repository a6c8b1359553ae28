"""Build transformers' reference DiffusionGemma with every parameter and buffer randomised, save it with
save_pretrained, and hand both to the parity tests. transformers is imported here only (tests' oracle)."""

from __future__ import annotations

import math

import torch

from dgcli.checkpoint.random_weights import TINY_VISION, make_config

S, F = "sliding_attention", "full_attention"

# Random configs of several shapes: layer-type patterns, GQA groups 1, 2 and >=4, global head dim
# != head dim, small sliding windows so prompts exceed them, canvases of 8..64.
CONFIGS = {
    "gqa2_window6": dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         num_global_key_value_heads=1, head_dim=8, global_head_dim=16, num_experts=4,
                         top_k_experts=2, sliding_window=6, layer_types=[S, S, F], canvas=8),
    "gqa1_full_first": dict(vocab_size=80, hidden_size=24, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                            num_global_key_value_heads=2, head_dim=12, global_head_dim=8, num_experts=3,
                            top_k_experts=3, sliding_window=5, layer_types=[F, S, S, F], canvas=16),
    "gqa4_moe8": dict(vocab_size=128, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      num_global_key_value_heads=1, head_dim=8, global_head_dim=32, num_experts=8,
                      top_k_experts=2, sliding_window=9, layer_types=[S, F], canvas=64),
    "gqa8_deep": dict(vocab_size=64, hidden_size=32, intermediate_size=24, moe_intermediate_size=8,
                      num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=1,
                      num_global_key_value_heads=1, head_dim=4, global_head_dim=8, num_experts=5,
                      top_k_experts=1, sliding_window=4, layer_types=[S, S, S, S, S, F], canvas=12),
}


# A tiny config with a vocabulary large enough for a tokenizer: CLI, bench and sweep tests.
CLI_TEXT = dict(vocab_size=400, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1, head_dim=16,
                global_head_dim=16, num_experts=4, top_k_experts=2, sliding_window=24, layer_types=[S, F],
                max_position_embeddings=4096)
CLI_CANVAS = 16


def text_config(name: str) -> tuple[dict, int]:
    cfg = dict(CONFIGS[name])
    canvas = cfg.pop("canvas")
    cfg["max_position_embeddings"] = 4096
    return cfg, canvas


@torch.no_grad()
def randomise_(model, seed: int) -> None:
    """Every parameter and buffer random; gains around 1 so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name or "embed_scale" in name or "vision" in name:
            continue  # derived constants, or not part of the text path
        if t.ndim >= 2:
            t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1]))
        else:
            t.copy_(torch.rand(t.shape, generator=g) + 0.5)


def reference_from_text(tc: dict, canvas: int, seed: int = 0, dtype=torch.float32):
    """transformers' DiffusionGemmaForBlockDiffusion for a text config (a tiny vision tower), every tensor random."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    full = make_config(tc, canvas_length=canvas)
    cfg = DiffusionGemmaConfig(text_config=full["text_config"], vision_config=dict(TINY_VISION),
                               canvas_length=canvas)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    randomise_(model, seed)
    return model.to(dtype)


def build_reference(name: str, seed: int = 0, dtype=torch.float32):
    return reference_from_text(*text_config(name), seed=seed, dtype=dtype)


# A tiny vision tower (patch 4, 2 x 2 pooling) for CLI and server tests: 16 x 16 pixels per soft token.
CLI_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                  position_embedding_size=64, standardize=True)
IMAGE_IDS = {"boi_token_id": 60, "image_token_id": 61, "eoi_token_id": 62}  # free <unused_N> slots of the tokenizer


def write_vision_checkpoint(out, seed: int = 0):
    """transformers' model of CLI_TEXT with CLI_VISION, every tensor random, saved with a tokenizer whose image
    tokens sit at IMAGE_IDS and a chat template that places an image part as <|image|> (as Gemma-4's does)."""
    import json

    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from dgcli.checkpoint.random_weights import SAMPLE_TEXT
    from dgcli.text.build import build_tokenizer, write_tokenizer_files

    text = dict(make_config(CLI_TEXT, CLI_CANVAS)["text_config"], use_bidirectional_attention="vision")
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=dict(CLI_VISION), canvas_length=CLI_CANVAS,
                               **IMAGE_IDS)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" not in name and "embed_scale" not in name:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1]) if t.ndim >= 2
                        else torch.rand(t.shape, generator=g) + 0.5)
    model.save_pretrained(out)
    write_tokenizer_files(build_tokenizer([SAMPLE_TEXT] * 4, CLI_TEXT["vocab_size"]), out)
    names = {60: "<|image>", 61: "<|image|>", 62: "<image|>"}
    tok = json.loads((out / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        if t["id"] in names:
            old, t["content"] = t["content"], names[t["id"]]
            tok["model"]["vocab"][t["content"]] = tok["model"]["vocab"].pop(old)
    (out / "tokenizer.json").write_text(json.dumps(tok))
    tpl = out / "chat_template.jinja"
    tpl.write_text(tpl.read_text().replace(
        "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}",
        "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
        "{%- elif part['type'] == 'image' -%}{{- '<|image|>' -}}{%- endif -%}"))
    return out


def write_picture(path, seed, size=(40, 24)) -> str:
    """A random RGB PNG (Pillow: the `[vision]` extra) at `path`, for the image tests; returns the path as text."""
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return str(path)
