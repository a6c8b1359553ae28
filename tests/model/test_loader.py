"""Loader: layouts it must read, and one clear error naming the culprit for each broken checkpoint."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dgcli
from dgcli.checkpoint.random_weights import make_config, random_model, write_checkpoint
from dgcli.errors import UserError
from hf_oracle import text_config


@pytest.fixture(scope="module")
def model_and_cfg():
    tc, canvas = text_config("gqa2_window6")
    cfg = make_config(tc, canvas_length=canvas)
    return random_model(cfg, seed=1), cfg


@pytest.fixture
def ckpt(tmp_path, model_and_cfg):
    model, cfg = model_and_cfg
    return write_checkpoint(model, tmp_path / "ck", cfg)


def logits(model):
    g = torch.Generator().manual_seed(0)
    v = model.config.vocab_size
    return model.forward_canvas(torch.randint(0, v, (1, 9), generator=g),
                                torch.randint(0, v, (1, model.config.canvas_length), generator=g))


def test_single_file_and_sharded_load_the_same(tmp_path, model_and_cfg):
    model, cfg = model_and_cfg
    a = dgcli.load_model(write_checkpoint(model, tmp_path / "one", cfg))
    b = dgcli.load_model(write_checkpoint(model, tmp_path / "four", cfg, shards=4))
    assert len(list((tmp_path / "four").glob("model-*.safetensors"))) == 4
    assert torch.equal(logits(a), logits(b))
    assert torch.equal(logits(a), logits(model))


def test_bf16_checkpoint_stores_fp32_layer_scalars_and_loads_all_in_one_dtype(tmp_path, model_and_cfg):
    # As released: bf16 weights, fp32 layer scalars. Loaded, every tensor is in the compute dtype, as
    # transformers holds them (test_model_parity checks the values against it).
    model, cfg = model_and_cfg
    m16 = random_model(cfg, seed=1, dtype=torch.bfloat16)
    assert {t.dtype for t in m16.state_dict().values()} == {torch.bfloat16}
    path = write_checkpoint(m16, tmp_path / "bf16", cfg)
    stored = load_file(path / "model.safetensors")
    assert stored["model.decoder.layers.0.layer_scalar"].dtype == torch.float32
    assert stored["model.encoder.language_model.layers.0.layer_scalar"].dtype == torch.float32
    assert stored["model.decoder.embed_tokens.weight"].dtype == torch.bfloat16
    loaded = dgcli.load_model(path)
    assert {t.dtype for t in loaded.state_dict().values()} == {torch.bfloat16}
    assert torch.equal(logits(loaded), logits(m16))  # the dummy model is its checkpoint, loaded back
    m32 = dgcli.load_model(path, dtype="float32")
    assert {t.dtype for t in m32.state_dict().values()} == {torch.float32}
    # fp32 scalars loaded in bf16 are rounded (to nearest), as transformers rounds them.
    stored["model.decoder.layers.0.layer_scalar"] = torch.tensor([0.3001])
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert dgcli.load_model(path).layers[0].layer_scalar.item() == 0.30078125
    assert dgcli.load_model(path, dtype="float32").layers[0].layer_scalar.item() == torch.tensor(0.3001).item()


def test_a_partial_vision_tower_is_one_line(tmp_path, ckpt):
    # The vision tower loads with the model (images in the prompt): a partial one is a partial checkpoint.
    (ckpt / "model-vision.safetensors").write_bytes(b"\x00" * 10)
    names = list(load_file(ckpt / "model.safetensors"))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map["model.encoder.vision_tower.encoder.layers.0.mlp.weight"] = "model-vision.safetensors"
    weight_map["model.encoder.embed_vision.embedding_projection.weight"] = "model-vision.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    expect(ckpt, "vision_tower", "is a shard missing?")


def rewrite(ckpt, change):
    state = load_file(ckpt / "model.safetensors")
    change(state)
    save_file(state, str(ckpt / "model.safetensors"))


def expect(path, *needles):
    with pytest.raises(UserError) as e:
        dgcli.load_model(path)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def test_missing_directory(tmp_path):
    expect(tmp_path / "nope", "nope", "no such checkpoint directory")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    expect(ckpt, "no config.json", "not a checkpoint directory")


def test_not_a_diffusion_gemma_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "gemma4"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    expect(ckpt, "gemma4", "diffusion_gemma")


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    expect(ckpt, "model.safetensors")


def test_missing_shard(tmp_path, model_and_cfg):
    model, cfg = model_and_cfg
    path = write_checkpoint(model, tmp_path / "sh", cfg, shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    expect(path, "model-00002-of-00003.safetensors", "missing")


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda s: s.pop("model.decoder.layers.1.router.scale"))
    expect(ckpt, "model.decoder.layers.1.router.scale")


def test_missing_encoder_scalar(ckpt):
    rewrite(ckpt, lambda s: s.pop("model.encoder.language_model.layers.2.layer_scalar"))
    expect(ckpt, "model.encoder.language_model.layers.2.layer_scalar")


def test_unexpected_text_tensor(ckpt):
    rewrite(ckpt, lambda s: s.update({"model.decoder.layers.2.self_attn.v_proj.weight": torch.zeros(16, 32)}))
    expect(ckpt, "model.decoder.layers.2.self_attn.v_proj.weight", "unexpected")


def test_wrong_shape(ckpt):
    rewrite(ckpt, lambda s: s.update({"model.decoder.layers.0.experts.gate_up_proj": torch.zeros(4, 12, 32)}))
    expect(ckpt, "model.decoder.layers.0.experts.gate_up_proj", "[4, 12, 32]", "[4, 24, 32]")


def test_wrong_dtype(ckpt):
    rewrite(ckpt, lambda s: s.update({"model.decoder.norm.weight": torch.zeros(32, dtype=torch.int32)}))
    expect(ckpt, "model.decoder.norm.weight", "int32")


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    expect(ckpt, "model.safetensors", "truncated")


def test_corrupt_header(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(b"\xff" * 64)
    expect(ckpt, "model.safetensors", "corrupt")


def test_config_missing_key(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["text_config"]["num_experts"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    expect(ckpt, "num_experts")


def test_released_config_parses_with_real_geometry():
    from dgcli.checkpoint.config import real_config_path
    from dgcli.checkpoint.load import load_config

    cfg = load_config(real_config_path())
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23, 29]
    g = cfg.layer(5)
    assert (g.head_dim, g.num_kv_heads, g.window, g.has_v_proj) == (512, 2, None, False)
    assert g.rope.rotary_pairs == 64 and g.rope.theta == 1e6
    s = cfg.layer(0)
    assert (s.head_dim, s.num_kv_heads, s.window, s.rope.rotary_pairs) == (256, 8, 1024, 128)
    assert cfg.self_conditioning_size == 2112 and cfg.canvas_length == 256
