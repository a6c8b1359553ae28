"""The card's FP8 arithmetic: an FP8 config's weights, bytes by dtype and per-step bytes count its e4m3
matrices at 1 byte plus one scale per output channel; FLOPs do not change."""

import pytest
from hf_oracle import text_config

from dgcli.measure import cost as info
from dgcli.checkpoint.config import parse_config, real_config_path, read_json
from dgcli.checkpoint.random_weights import make_config, random_model, with_fp8


def test_fp8_bytes_are_the_models_own_bytes():
    tc, canvas = text_config("gqa4_moe8")
    raw = with_fp8(make_config(tc, canvas_length=canvas))
    cfg = parse_config(raw)
    import torch

    m = random_model(raw, dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    scalars = info.param_counts(cfg)["layer_scalars"]
    assert info.weights_bytes_total(cfg, 2) == held + 2 * scalars  # the model holds its scalars in bf16
    by = info.bytes_by_dtype_for(cfg, "bfloat16")
    assert by["float8_e4m3"] == sum(t.numel() for t in m.state_dict().values() if t.dtype == torch.float8_e4m3fn)
    assert sum(by.values()) == info.weights_bytes_total(cfg, 2)


def test_fp8_roofline_of_the_released_model():
    raw = read_json(real_config_path())
    bf16, fp8 = parse_config(raw), parse_config(with_fp8(raw))
    a, b = info.step_cost(bf16, 256, weight_bytes=2), info.step_cost(fp8, 256, weight_bytes=2)
    assert a.flops == b.flops
    # a step reads nearly every expert: the FP8 step reads a bit over half the bytes
    assert 0.5 < b.bytes / a.bytes < 0.6
    q, rows = info.quantized_counts(bf16)
    assert b.bytes == pytest.approx(a.bytes - q + 2 * rows, rel=0.01)  # every matrix read once at 256 tokens
    card = info.card(fp8, name="x", source="y", dtype="bfloat16")
    assert card["memory"]["weights"] == info.weights_bytes_total(fp8, 2)
    assert 26e9 < card["memory"]["weights"] < 29e9 and card["weights"].startswith("fp8 (FP8_DYNAMIC")
    assert info.block_cost(fp8, 256, 3, 3, weight_bytes=0, kv_bytes=2).bytes == \
        info.block_cost(bf16, 256, 3, 3, weight_bytes=0, kv_bytes=2).bytes  # weights not counted: none


def test_info_on_an_fp8_checkpoint(cli_ckpt, tmp_path, capsys):
    """`dgemma info` runs an FP8 checkpoint in its unquantized tensors' dtype and sizes its weights as held."""
    import json

    from cli_run import run

    import dgcli
    from dgcli.checkpoint.quantize import quantize_checkpoint

    quantize_checkpoint(cli_ckpt, tmp_path / "fp8")
    code, out, err = run(["info", str(tmp_path / "fp8"), "--format", "json", "--no-measure-peaks"], capsys)
    assert code == 0, err
    card = json.loads(out)
    assert card["dtype"] == "float32" and card["weights"].startswith("fp8")
    assert card["bytes_by_dtype"]["float8_e4m3"] > 0
    m = dgcli.load_model(tmp_path / "fp8")
    assert card["memory"]["weights"] == sum(t.numel() * t.element_size() for t in m.state_dict().values())


def test_info_fit_table_has_an_nvfp4_row_sized_as_an_nvfp4_model_holds_it(tmp_path, capsys):
    """`dgemma info`'s largest-batch table: per memory, an nvfp4 row beside bf16 and fp8, its weights the bytes a
    model of the config holds with `dgemma quantize --nvfp4`'s matrices, so it fits at least fp8's batch."""
    import json

    import torch
    from cli_run import run

    tc, canvas = text_config("gqa4_moe8")
    raw = make_config(tc, canvas_length=canvas)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    code, out, err = run(["info", "--dummy", str(tmp_path / "config.json"), "--format", "json", "--no-measure-peaks"],
                         capsys)
    assert code == 0, err
    sec = json.loads(out)["batch_memory"]
    m = random_model(with_fp8(raw, nvfp4=True), dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    assert sec["weights"]["nvfp4"]["bytes"] == held + 2 * info.param_counts(parse_config(raw))["layer_scalars"]
    fits = {(f["memory"], f["weights"]): f for f in sec["fits"]}
    for memory in {f["memory"] for f in sec["fits"]}:
        b = [fits[memory, w]["largest_batch"] for w in ("bf16", "fp8", "nvfp4")]
        assert b == sorted(b), memory
        assert fits[memory, "nvfp4"]["weights_bytes"] == sec["weights"]["nvfp4"]["bytes"]
