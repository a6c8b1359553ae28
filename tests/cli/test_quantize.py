"""`dgemma quantize SRC DST --fp8` end to end: the FP8 checkpoint it writes generates, and bad input is one line."""

import json

from cli_run import run


def test_quantize_then_generate(cli_ckpt, tmp_path, capsys):
    dst = tmp_path / "fp8"
    code, out, err = run(["quantize", str(cli_ckpt), str(dst), "--fp8"], capsys)
    assert code == 0, err
    assert out.startswith(f"{dst}: FP8-dynamic checkpoint") and out.count("\n") == 1
    assert "quantizing model.safetensors" in err
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    assert (dst / "tokenizer.json").read_bytes() == (cli_ckpt / "tokenizer.json").read_bytes()
    code, out, err = run(["generate", "--model", str(dst), "--diffusion-steps", "2", "--format", "json", "hello"], capsys)
    assert code == 0, err
    assert json.loads(out)["finish_reason"] in ("stop", "length")


def test_quantize_errors_are_one_line(cli_ckpt, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for argv, needle in ((["quantize", str(cli_ckpt), str(tmp_path / "a")], "--fp8"),
                         (["quantize", str(cli_ckpt), str(tmp_path / "full"), "--fp8"], "not empty"),
                         (["quantize", str(tmp_path / "nope"), str(tmp_path / "b"), "--fp8"], "no such checkpoint"),
                         (["quantize", str(cli_ckpt), str(tmp_path / "x.gguf"), "--fp8"], "not a GGUF file")):
        code, out, err = run(argv, capsys)
        assert code == 2 and out == ""
        assert err.startswith("dgemma: error:") and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "x.gguf").exists()  # nothing written
