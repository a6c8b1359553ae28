"""Flag checks from issue 14: bench/sweep counts rejected before anything is loaded, `info` on a truncated
safetensors file, and `info` taking the model both as MODEL and as -m/--model like every other command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dgcli.errors import UserError
from dgcli.checkpoint.random_weights import write_random_checkpoint

from cli_run import forbid
from hf_oracle import CLI_CANVAS, CLI_TEXT

FAST = ["--random-prompts", "--random-input-len", "4", "--no-measure-peaks"]


def invoke(*args):
    from dgcli.cli import app

    return CliRunner().invoke(app, list(args))


def one_line_error(r, *words):
    assert isinstance(r.exception, UserError), (r.output, r.exception)
    msg = str(r.exception)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Loading the model (or resolving its settings) fails the test: the checks must come first."""
    from dgcli.measure import bench as b
    from dgcli.runtime import session

    forbid(monkeypatch, ((session, "open_any"), (session, "resolve_for"), (b, "device_peaks")),
           "the model was opened before the flags were checked")


# ---- item 2: bench and sweep counts ----------------------------------------------------------------------


@pytest.mark.parametrize("flags, words", [
    (["--num-prompts", "-3"], ["--num-prompts -3", ">= 1"]),
    (["--num-prompts", "0"], ["--num-prompts 0", ">= 1"]),
    (["--runs", "0"], ["--runs 0", ">= 1"]),
    (["--warmup", "-1"], ["--warmup -1", ">= 0"]),
    (["--random-input-len", "0"], ["--random-input-len 0", ">= 1"]),
])
def test_bench_rejects_bad_counts_before_loading(cli_ckpt, nothing_loaded, flags, words):
    one_line_error(invoke("bench", "--model", str(cli_ckpt), *FAST, *flags), *words)


@pytest.mark.parametrize("flags, words", [
    (["--runs", "0", "--dry-run"], ["--runs 0"]),
    (["--num-prompts", "0", "--dry-run"], ["--num-prompts 0"]),
    (["--num-prompts", "-2"], ["--num-prompts -2"]),
    (["--warmup", "-1", "--dry-run"], ["--warmup -1"]),
])
def test_sweep_rejects_bad_counts_before_loading(cli_ckpt, nothing_loaded, tmp_path, flags, words):
    out = tmp_path / "s.jsonl"
    one_line_error(invoke("sweep", "--model", str(cli_ckpt), "--output", str(out), *FAST, *flags), *words)
    assert not out.exists()


def test_build_prompts_refuses_a_slice_from_the_end(tmp_path):
    from dgcli.measure.workload import build_prompts

    with pytest.raises(UserError, match="--num-prompts -3"):
        build_prompts(None, prompts_file=str(tmp_path / "p.jsonl"), random_ids=False, num_prompts=-3,
                      input_len=4, seed=0, warn=print)


def test_bench_num_prompts_takes_the_first_n(cli_ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(5)))
    r = invoke("bench", "--model", str(cli_ckpt), "--prompts", str(prompts), "--num-prompts", "2", "--runs", "1",
               "--warmup", "0", "--diffusion-steps", "2", "--no-measure-peaks", "--format", "json")
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.stdout)["rows"][0]["num_prompts"] == 2


# ---- item 5: info checks each file's size against its header ---------------------------------------------


@pytest.fixture
def small_ckpt(tmp_path):
    return write_random_checkpoint(tmp_path / "c", CLI_TEXT, canvas_length=CLI_CANVAS, tokenizer=False)


@pytest.mark.parametrize("cut, words", [(-100, ["truncated", "re-copy"]), (+7, ["corrupt"]),
                                        ("head", ["not a readable safetensors file", "download it again"])])
def test_info_rejects_a_file_that_does_not_match_its_header(small_ckpt, cut, words):
    f = next(small_ckpt.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[:20] if cut == "head" else data[:cut] if cut < 0 else data + b"\0" * cut)
    msg = one_line_error(invoke("info", str(small_ckpt), "--no-measure-peaks"), str(f), *words)
    if cut != "head":
        assert f"describes {len(data)} bytes, the file has {f.stat().st_size}" in msg


def test_info_accepts_a_whole_file(small_ckpt):
    r = invoke("info", str(small_ckpt), "--no-measure-peaks", "--format", "json")
    assert r.exit_code == 0, (r.output, r.exception)


# ---- item 6: info takes -m/--model too ---------------------------------------------------------------------


def test_info_takes_the_model_as_argument_or_option(cli_ckpt):
    cards = []
    for args in ([str(cli_ckpt)], ["-m", str(cli_ckpt)], ["--model", str(cli_ckpt)],
                 [str(cli_ckpt), "--model", str(cli_ckpt)]):
        r = invoke("info", *args, "--no-measure-peaks", "--format", "json")
        assert r.exit_code == 0, (args, r.output, r.exception)
        cards.append(json.loads(r.stdout)["source"])
    assert len(set(cards)) == 1 and str(cli_ckpt) in cards[0]


def test_info_two_different_models_is_one_line(cli_ckpt, tmp_path):
    one_line_error(invoke("info", str(cli_ckpt), "-m", str(tmp_path), "--no-measure-peaks"), "two models")
    one_line_error(invoke("info", "-m", str(cli_ckpt), "--dummy", "26B-A4B", "--no-measure-peaks"), "--dummy")


def test_bench_show_config_resolves_without_loading(cli_ckpt, monkeypatch):
    """bench takes --preset and the sampler flags, so --show-config shows what they resolve to (a --dummy config
    as its session runs it: fixed work), without loading anything."""
    from dgcli.runtime import session

    forbid(monkeypatch, ((session, "open_any"),), "bench --show-config loaded the model")
    r = invoke("bench", "-m", str(cli_ckpt), "--diffusion-steps", "8", "--show-config")
    assert r.exit_code == 0 and "max_denoising_steps   8       flag" in r.stdout, r.output
    r = invoke("bench", "--dummy", "26B-A4B", "--layers", "2", "--show-config", "--format", "json")
    doc = json.loads(r.stdout)
    assert doc["model"].startswith("dummy diffusiongemma-26B-A4B") and doc["params"]["confidence_threshold"] == 0.0
    one_line_error(invoke("bench", "--show-config", "--base-url", "http://127.0.0.1:9/v1"), "--show-config", "drop one")
    # a flag the plan would leave out is refused, as a run refuses it
    one_line_error(invoke("bench", "--dummy", "26B-A4B", "-m", str(cli_ckpt), "--show-config"), "--dummy", "not both")
    one_line_error(invoke("bench", "-m", str(cli_ckpt), "--layers", "2", "--show-config"), "--layers")


def test_info_takes_the_dtypes_the_other_commands_take(cli_ckpt):
    """--dtype float16 is refused as generate refuses it (a float16 checkpoint's own dtype is still described)."""
    one_line_error(invoke("info", "-m", str(cli_ckpt), "--dtype", "float16", "--no-measure-peaks"),
                   "--dtype float16: use auto, bfloat16 or float32")


# ---- item 10c: --result-dir / --result-filename imply --save-result --------------------------------------


@pytest.mark.parametrize("extra", [[], ["--result-filename", "r.json"]])
def test_bench_result_dir_implies_save_result(cli_ckpt, tmp_path, extra):
    out = tmp_path / "results"
    r = invoke("bench", "--model", str(cli_ckpt), *FAST, "--num-prompts", "1", "--runs", "1", "--warmup", "0",
               "--diffusion-steps", "2", "--format", "json", "--result-dir", str(out), *extra)
    assert r.exit_code == 0, (r.output, r.exception)
    saved = list(out.glob("*.json"))
    assert len(saved) == 1 and len(json.loads(saved[0].read_text())["rows"]) == 1
    if extra:
        assert saved[0].name == "r.json"


def test_bench_refuses_a_result_place_it_cannot_write_before_measuring(cli_ckpt, tmp_path, nothing_loaded):
    """A run that cannot be saved stops before the model loads, not after the measuring."""
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [(["--result-dir", str(afile)], "is a file; name a folder"),
             (["--result-dir", str(tmp_path), "--result-filename", "nodir/r.json"], "--result-filename: cannot write in"),
             (["--result-dir", str(tmp_path.parent), "--result-filename", tmp_path.name], "is a folder; name a file")]
    for extra, says in cases:
        one_line_error(invoke("bench", "--model", str(cli_ckpt), *FAST, "--runs", "1", *extra), says)


def test_preset_from_a_pipe(cli_ckpt):
    """`--preset <(...)` (bash's process substitution: a /dev/fd/N path naming a pipe) is read like a file."""
    import os

    read, write = os.pipe()
    os.write(write, b"max_denoising_steps: 8\n")
    os.close(write)
    try:
        r = invoke("bench", "-m", str(cli_ckpt), "--preset", f"/dev/fd/{read}", "--show-config")
    finally:
        os.close(read)
    assert r.exit_code == 0 and "max_denoising_steps   8       preset" in r.stdout, r.output
