"""FP8-dynamic checkpoints (compressed-tensors layout): what `quantize` writes, what the loader keeps in memory,
and weight-only logits equal to those of the bf16 checkpoint holding the dequantized weights."""

import contextlib
import json

import pytest
import torch
from hf_oracle import text_config
from test_loader import expect  # one error line naming the problem
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dgcli
from dgcli.errors import UserError
from dgcli.checkpoint import compressed_tensors as fp8_ckpt
from dgcli.checkpoint.meta import dequantize_model
from dgcli.model import fp8
from dgcli.checkpoint.quantize import quantize_checkpoint
from dgcli.checkpoint.random_weights import make_config, random_model, with_fp8, write_checkpoint
from passes import Seqs, decode, encode

FP8 = torch.float8_e4m3fn
KERNEL_MODES = ["reference", "auto"]  # DGEMMA_KERNELS: whole-matrix dequantization, or the CPU tiled/segment paths
BF16_TOL = 0.02  # as test_model_parity: one bf16 step of a logit below 4 (measured here: 0.0)


@pytest.fixture(scope="module", params=["gqa4_moe8", "gqa2_window6"])
def ckpts(request, tmp_path_factory):
    """(bf16 checkpoint, its FP8 twin written by `quantize`)."""
    tc, canvas = text_config(request.param)
    cfg = make_config(tc, canvas_length=canvas)
    root = tmp_path_factory.mktemp(request.param)
    src = write_checkpoint(random_model(cfg, seed=5, dtype=torch.bfloat16), root / "bf16", cfg, shards=2)
    (src / "tokenizer.json").write_text("{}")  # stands for the files quantize copies
    (src / "chat_template.jinja").write_text("{{ bos_token }}")
    dst = root / "fp8"
    quantize_checkpoint(src, dst)
    return src, dst


def read_all(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def inputs(cfg, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (batch, cfg.sliding_window * 2 + 3), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (batch, cfg.canvas_length), generator=g)
    sc = (torch.randn(batch, cfg.canvas_length, cfg.vocab_size, generator=g) * 4).bfloat16()
    return prompt, canvas, sc


def test_quantized_layout(ckpts):
    src, dst = ckpts
    a, b = read_all(src), read_all(dst)
    cfg = json.loads((dst / "config.json").read_text())
    tc = cfg["text_config"]
    e, inter, h = tc["num_experts"], tc["moe_intermediate_size"], tc["hidden_size"]
    for key, t in a.items():
        if key.endswith("_proj.weight") and (".self_attn." in key or ".mlp." in key):
            assert b[key].dtype == FP8 and b[key].shape == t.shape, key
            assert b[key + "_scale"].dtype == torch.bfloat16 and b[key + "_scale"].shape == (t.shape[0], 1)
        elif key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert key not in b  # unfused: experts.{i}.gate_proj / up_proj / down_proj
        else:
            assert torch.equal(b[key], t), key  # embedding, norms, router, self-conditioning, scalars: as they were
    base = "model.decoder.layers.1.experts"
    for i in range(e):
        assert b[f"{base}.{i}.gate_proj.weight"].shape == b[f"{base}.{i}.up_proj.weight"].shape == (inter, h)
        assert b[f"{base}.{i}.down_proj.weight"].shape == (h, inter)
        assert b[f"{base}.{i}.down_proj.weight_scale"].shape == (h, 1)
    fused = a[f"{base}.gate_up_proj"]
    q, s = fp8.quantize_rows(fused[3, inter:])
    assert torch.equal(b[f"{base}.3.up_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(b[f"{base}.3.up_proj.weight_scale"], s)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(b) and len(set(index["weight_map"].values())) == 2
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    assert "model.decoder.layers.0.router.proj" in qc["ignore"] and "lm_head" in qc["ignore"]
    assert (dst / "tokenizer.json").read_text() == "{}" and (dst / "chat_template.jinja").exists()
    assert (dst / "generation_config.json").read_text() == (src / "generation_config.json").read_text()


def test_quantization_is_compressed_tensors(ckpts):
    """Our per-channel absmax quantization and config against compressed-tensors' own code: scales from its
    calculate_qparams, weights from its quantize, and its QuantizationConfig parsing what we write."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).weights
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        w = (torch.randn(24, 40, generator=g) * torch.rand(24, 1, generator=g) * 3).to(dtype)
        w[5] = 0  # a zero row: compressed-tensors' eps scale
        s_ct, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
        q_ct = quantize(w, s_ct, zp, args, dtype=FP8)
        q, s = fp8.quantize_rows(w)
        assert s.dtype == s_ct.dtype == dtype and torch.equal(s, s_ct)
        assert torch.equal(q.view(torch.uint8), q_ct.view(torch.uint8))
    _, dst = ckpts
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    want = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])})
    got, scheme = parsed.config_groups["group_0"], want.config_groups["group_0"]
    assert (got.weights, got.input_activations, got.targets) == (scheme.weights, scheme.input_activations, scheme.targets)
    assert got.format == parsed.format == "float-quantized"
    assert qc["version"] == fp8_ckpt.CT_VERSION and ct.__version__ >= "0.15"


def test_loader_keeps_one_byte_per_weight(ckpts):
    src, dst = ckpts
    m = dgcli.load_model(dst)
    state = m.state_dict()
    layer = m.layers[0]
    assert isinstance(layer.experts, fp8.FP8Experts) and isinstance(layer.self_attn.q_proj, fp8.FP8Linear)
    assert layer.experts.gate_up_proj.dtype == FP8 and layer.experts.gate_up_proj_scale.dtype == torch.bfloat16
    assert m.layers[0].router.proj.weight.dtype == torch.bfloat16  # the router is not quantized
    stored = sum(t.numel() * t.element_size() for t in read_all(dst).values())
    held = sum(t.numel() * t.element_size() for t in state.values())
    scalars = 2 * m.config.num_hidden_layers  # stored fp32, loaded bf16 like every unquantized tensor
    assert held == stored - 2 * scalars  # nothing widened: FP8 weights at one byte, scales as stored
    # The fused experts hold exactly the per-expert tensors, gate rows first
    b = read_all(dst)
    inter = m.config.moe_intermediate_size
    assert torch.equal(layer.experts.gate_up_proj[2, inter:].view(torch.uint8),
                       b["model.decoder.layers.0.experts.2.up_proj.weight"].view(torch.uint8))
    assert torch.equal(layer.experts.down_proj_scale[1], b["model.decoder.layers.0.experts.1.down_proj.weight_scale"])
    f32 = dgcli.load_model(dst, dtype="float32")  # --dtype casts the unquantized tensors only
    assert f32.embed_weight.dtype == torch.float32 and f32.layers[0].experts.down_proj.dtype == FP8


@pytest.mark.parametrize("kernels", KERNEL_MODES)
def test_weight_only_logits_equal_the_dequantized_bf16_checkpoint(ckpts, tmp_path, monkeypatch, kernels):
    """The FP8 checkpoint run weight-only against the bf16 checkpoint holding e4m3 x scale, both in bf16, on
    the reference path (whole matrices dequantized) and the CPU paths (row tiles, expert chunks and
    grouped_mm segments: several tiles are tests/kernels/test_fp8_kernels.py's), with and without
    self-conditioning, and after a committed block."""
    _, dst = ckpts
    monkeypatch.setenv("DGEMMA_KERNELS", kernels)
    ours = dgcli.load_model(dst)
    deq = write_checkpoint(dequantize_model(ours), tmp_path / "deq", json.loads((dst / "config.json").read_text()))
    assert "quantization_config" not in json.loads((deq / "config.json").read_text())
    plain = dgcli.load_model(deq)
    assert not fp8.is_fp8(plain) and plain.embed_weight.dtype == torch.bfloat16
    prompt, canvas, sc = inputs(ours.config)
    for a, b in ((ours.forward_canvas(prompt, canvas), plain.forward_canvas(prompt, canvas)),
                 (ours.forward_canvas(prompt, canvas, sc), plain.forward_canvas(prompt, canvas, sc))):
        assert (a - b).abs().max().item() <= BF16_TOL
    block = torch.randint(0, ours.config.vocab_size, canvas.shape, generator=torch.Generator().manual_seed(1))
    got = []
    for m in (ours, plain):
        kv = Seqs(m, 2, prompt.shape[1] + block.shape[1])
        encode(m, prompt, kv)
        encode(m, block, kv)
        got.append(m.logits(decode(m, canvas, kv, m.soft_embedding(sc))))
    assert (got[0] - got[1]).abs().max().item() <= BF16_TOL


def test_dynamic_activations_run_and_differ(ckpts, monkeypatch):
    """DGEMMA_FP8=dynamic changes the numbers (activations in e4m3), on both kernel modes alike."""
    _, dst = ckpts
    ours = dgcli.load_model(dst)
    prompt, canvas, _ = inputs(ours.config, batch=1)
    weight_only = ours.forward_canvas(prompt, canvas)
    monkeypatch.setenv("DGEMMA_FP8", "dynamic")
    dyn = ours.forward_canvas(prompt, canvas)
    monkeypatch.setenv("DGEMMA_KERNELS", "reference")
    assert torch.equal(dyn, ours.forward_canvas(prompt, canvas))
    assert torch.isfinite(dyn).all() and (dyn - weight_only).abs().max() > BF16_TOL


@contextlib.contextmanager
def fused_experts_mapping():
    """transformers has no conversion from per-expert linears back to DiffusionGemma's fused experts (it
    reports them unexpected and leaves the experts random): register llm-compressor's inverse for the test
    only (it would also unfuse experts on every later save_pretrained in this process)."""
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    cm.register_checkpoint_conversion_mapping("diffusion_gemma", [
        WeightConverter(source_patterns=["experts.*.gate_proj.weight", "experts.*.up_proj.weight"],
                        target_patterns="experts.gate_up_proj", operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns="experts.*.down_proj.weight", target_patterns="experts.down_proj",
                        operations=[MergeModulelist(dim=0)]),
    ], overwrite=True)
    try:
        yield
    finally:
        cm._checkpoint_conversion_mapping_cache.pop("diffusion_gemma", None)
        cm.USER_REGISTERED_MAPPINGS.discard("diffusion_gemma")


def test_transformers_with_compressed_tensors_reads_the_same_checkpoint(ckpts):
    pytest.importorskip("compressed_tensors")
    from transformers import CompressedTensorsConfig, DiffusionGemmaForBlockDiffusion

    from dgcli.checkpoint.directory import to_checkpoint_name

    _, dst = ckpts
    with fused_experts_mapping():
        ref = DiffusionGemmaForBlockDiffusion.from_pretrained(
            dst, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True),
            experts_implementation="eager").eval()
    ours = dgcli.load_model(dst)
    theirs = ref.state_dict()
    for name, t in dequantize_model(ours).state_dict().items():
        assert torch.equal(theirs[to_checkpoint_name(name)], t), name
    prompt, canvas, sc = inputs(ours.config, batch=1)
    with torch.no_grad():
        want = ref(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=sc).logits
    assert (ours.forward_canvas(prompt, canvas, sc) - want).abs().max().item() <= BF16_TOL


def test_dummy_fp8_model_and_its_checkpoint(tmp_path):
    tc, canvas = text_config("gqa2_window6")
    cfg = with_fp8(make_config(tc, canvas_length=canvas))
    m = random_model(cfg, seed=2, dtype=torch.bfloat16)
    assert fp8.is_fp8(m) and m.layers[1].mlp.down_proj.weight.dtype == FP8
    assert m.layers[1].mlp.down_proj.weight_scale.dtype == torch.bfloat16
    assert all(torch.isfinite(t.float()).all() for t in m.state_dict().values())
    back = dgcli.load_model(write_checkpoint(m, tmp_path / "ck", cfg, shards=3))
    prompt, canvas_ids, _ = inputs(m.config, batch=1)
    assert torch.equal(back.forward_canvas(prompt, canvas_ids), m.forward_canvas(prompt, canvas_ids))


# ---- one line naming the problem ----------------------------------------------------------------------------


def with_qc(path, qc):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))


def ct_group(weights, acts=None, fmt="float-quantized"):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


@pytest.mark.parametrize("qc, name", [
    (ct_group({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True},
              fmt="mxfp4-pack-quantized"), "MXFP4A16"),  # NVFP4 runs (tests/model/test_nvfp4.py)
    (ct_group({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True},
              fmt="pack-quantized"), "W4A16"),
    (ct_group({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
              {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}, "int-quantized"), "W8A8"),
    (ct_group({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "symmetric": True},
              {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}), "FP8_BLOCK"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq bits=4 group_size=128"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "awq bits=4"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8 weight_block_size=[128, 128]"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes load_in_4bit=True"),
])
def test_unsupported_quantization_names_the_scheme(ckpts, tmp_path, qc, name):
    src, _ = ckpts
    path = tmp_path / "ck"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).symlink_to(f)
    (path / "config.json").unlink()
    (path / "config.json").write_text((src / "config.json").read_text())
    with_qc(path, qc)
    expect(path, name, "not supported", "dgemma quantize")


def test_kv_cache_scheme_and_uncompressed_status_are_refused(ckpts, tmp_path):
    _, dst = ckpts
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    cfg = json.loads((dst / "config.json").read_text())
    for change, needle in (({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
                           ({"quantization_status": "frozen"}, "frozen")):
        with pytest.raises(UserError, match=needle):
            from dgcli.checkpoint.config import parse_config

            parse_config(dict(cfg, quantization_config={**qc, **change}))


def copy_ckpt(dst, tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    for f in dst.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def rewrite(path, change):
    for f in sorted(path.glob("*.safetensors")):
        state = load_file(f)
        if change(state):
            save_file(state, str(f))


def test_missing_expert_tensor_is_named(ckpts, tmp_path):
    path = copy_ckpt(ckpts[1], tmp_path)
    key = "model.decoder.layers.1.experts.3.up_proj.weight_scale"
    rewrite(path, lambda s: s.pop(key, None) is not None)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    expect(path, key, "lacks")


def test_quantized_weight_in_bf16_is_named(ckpts, tmp_path):
    path = copy_ckpt(ckpts[1], tmp_path)
    key = "model.decoder.layers.0.experts.1.gate_proj.weight"
    rewrite(path, lambda s: key in s and s.update({key: s[key].to(torch.bfloat16)}) is None)
    expect(path, key, "float8_e4m3fn")


def test_scales_without_quantization_config_are_unexpected(ckpts, tmp_path):
    path = copy_ckpt(ckpts[1], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    expect(path, "unexpected tensor", "weight")


def test_quantize_refuses_bad_targets(ckpts, tmp_path):
    src, dst = ckpts
    with pytest.raises(UserError, match="already quantized"):
        quantize_checkpoint(dst, tmp_path / "again")
    with pytest.raises(UserError, match="not empty"):
        quantize_checkpoint(src, dst)
    with safe_open(str(next(dst.glob("*.safetensors"))), "pt") as f:
        assert any(f.get_tensor(k).dtype == FP8 for k in f.keys())
