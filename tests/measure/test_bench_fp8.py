"""`bench --dummy CONFIG --weights fp8`: random FP8 weights, and the row says which FP8 semantics ran."""

import json

import pytest
from cli_run import run

FAST = ["--runs", "1", "--warmup", "0", "--num-prompts", "2", "--random-input-len", "8", "--diffusion-steps", "2",
        "--format", "jsonl", "--no-measure-peaks"]


@pytest.mark.parametrize("extra, semantics", [([], "weight-only"), (["--fp8-activations"], "dynamic")])
def test_dummy_fp8_rows_record_the_semantics(cli_ckpt, capsys, monkeypatch, extra, semantics):
    monkeypatch.setenv("DGEMMA_FP8", "weight-only")  # the flag sets it in-process; monkeypatch restores it
    code, out, err = run(["bench", "--dummy", str(cli_ckpt), "--weights", "fp8", *extra, *FAST], capsys)
    assert code == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    assert (row["weights"], row["fp8_semantics"], row["dummy_weights"]) == ("fp8", semantics, True)


def test_plain_rows_and_bad_flags(cli_ckpt, capsys):
    code, out, err = run(["bench", "--dummy", str(cli_ckpt), *FAST], capsys)
    assert code == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    assert row["fp8_semantics"] is None and row["weights"] == "float32"
    for argv, needle in ((["--dummy", str(cli_ckpt), "--weights", "fp4"], "--weights fp4"),
                         (["--model", str(cli_ckpt), "--weights", "fp8"], "dgemma quantize")):
        code, out, err = run(["bench", *argv, *FAST], capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, err
