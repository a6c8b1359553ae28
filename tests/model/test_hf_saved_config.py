"""config.json as transformers' save_pretrained writes it: `per_layer_config` holds only the full layers'
values that differ from the base ones, and no `global_head_dim`. A checkpoint whose full layers share the
sliding layers' head dim (and kv heads) is saved with `per_layer_config: {}`; it must load with the
geometry transformers builds from it, not the 512 default of a config that spells `global_head_dim`."""

import json

import pytest
import torch
from hf_oracle import TINY_VISION, randomise_, text_config

import dgcli
from dgcli.errors import UserError
from dgcli.checkpoint.config import parse_config
from dgcli.checkpoint.random_weights import make_config

FP32_TOL = 1e-4


def save_reference(path, global_head_dim=None, num_global_kv=None, seed=7):
    """A random transformers model of the gqa2_window6 shape (head_dim 8, layers S, S, F), saved with
    save_pretrained; returns it and its text_config as written."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    tc, canvas = text_config("gqa2_window6")
    if global_head_dim is not None:
        tc["global_head_dim"] = global_head_dim
    if num_global_kv is not None:
        tc["num_global_key_value_heads"] = num_global_kv
    full = make_config(tc, canvas_length=canvas)
    cfg = DiffusionGemmaConfig(text_config=full["text_config"], vision_config=dict(TINY_VISION), canvas_length=canvas)
    ref = DiffusionGemmaForBlockDiffusion(cfg).eval()
    randomise_(ref, seed)
    ref.save_pretrained(path)
    return ref, json.loads((path / "config.json").read_text())["text_config"]


# (global head dim, full layers' kv heads) -> the per_layer_config transformers writes for layer 2 (full)
CASES = [(8, 2, {}), (8, 1, {"2": {"num_key_value_heads": 1}}), (16, 1, {"2": {"head_dim": 16, "num_key_value_heads": 1}}),
         (16, 2, {"2": {"head_dim": 16}})]


@pytest.mark.parametrize("global_head_dim,num_global_kv,written", CASES)
def test_transformers_saved_checkpoint_loads_with_its_geometry(tmp_path, global_head_dim, num_global_kv, written):
    ref, text = save_reference(tmp_path, global_head_dim, num_global_kv)
    assert text["per_layer_config"] == written and "global_head_dim" not in text  # what the fix is about
    ours = dgcli.load_model(tmp_path)
    attn = ref.model.decoder.layers[2].self_attn  # the full-attention layer
    assert (ours.config.global_head_dim, ours.config.num_global_key_value_heads) == (global_head_dim, num_global_kv)
    assert attn.head_dim == global_head_dim and attn.k_proj.out_features == num_global_kv * global_head_dim
    g = torch.Generator().manual_seed(0)
    v, c = ours.config.vocab_size, ours.config.canvas_length
    prompt = torch.randint(0, v, (2, 15), generator=g)  # longer than the 6-token window
    canvas = torch.randint(0, v, (2, c), generator=g)
    sc = torch.randn(2, c, v, generator=g) * 4
    with torch.no_grad():
        want = ref(input_ids=prompt, decoder_input_ids=canvas).logits
        want_sc = ref(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=sc).logits
    assert (ours.forward_canvas(prompt, canvas) - want).abs().max() <= FP32_TOL
    assert (ours.forward_canvas(prompt, canvas, sc) - want_sc).abs().max() <= FP32_TOL


def raw_config(**text):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, top_k_experts=2,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return {"model_type": "diffusion_gemma", "text_config": {**base, **text}}


def test_global_head_dim_defaults_as_transformers_does():
    """No per_layer_config: `global_head_dim` or transformers' default 512, `num_global_key_value_heads` or
    the base count. With per_layer_config: it alone, `global_head_dim` ignored (as transformers ignores it)."""
    cfg = parse_config(raw_config())
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads) == (512, 2)
    cfg = parse_config(raw_config(global_head_dim=16, num_global_key_value_heads=1))
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads) == (16, 1)
    cfg = parse_config(raw_config(per_layer_config={}))
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads) == (8, 2)
    cfg = parse_config(raw_config(per_layer_config={}, global_head_dim=16))
    assert cfg.global_head_dim == 8 and cfg.rope_full.head_dim == 8
    cfg = parse_config(raw_config(per_layer_config={"2": {"head_dim": 32}}))
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads) == (32, 2)


def test_per_layer_config_dgemma_cannot_run_is_one_error():
    with pytest.raises(UserError, match="full-attention layers different head dims"):
        parse_config(raw_config(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention",
                                                                  "sliding_attention", "full_attention"],
                                per_layer_config={"1": {"head_dim": 16}}))
    with pytest.raises(UserError, match="sliding layer 0"):
        parse_config(raw_config(per_layer_config={"0": {"head_dim": 16}}))
    with pytest.raises(UserError, match="past the 3 layers"):
        parse_config(raw_config(per_layer_config={"5": {"head_dim": 16}}))
