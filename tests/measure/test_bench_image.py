"""`dgemma bench --image`: every timed prompt carries the image; the row reports the vision tower's time per request
apart and the image's prompt tokens; what bench cannot honour is one line, exit 2."""

import json

import pytest

from cli_run import run
from hf_oracle import write_picture as picture


def prompt_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("describe it", "what colour")))
    return str(f)


FAST = ["--runs", "1", "--warmup", "0", "--diffusion-steps", "2", "--blocks", "1", "--no-measure-peaks"]


def bench_rows(capsys, *args):
    code, out, err = run(["bench", *FAST, "--format", "json", *args], capsys)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("source", ["file", "random"])
def test_the_image_row_times_the_tower_per_request_and_counts_its_tokens(vision_ckpt, tmp_path, capsys, source):
    a, b = picture(tmp_path / "a.png", 0), picture(tmp_path / "b.png", 1, (24, 40))
    prompts = ["--prompts", prompt_file(tmp_path)] if source == "file" else [
        "--random-prompts", "--num-prompts", "2", "--random-input-len", "8"]
    text = bench_rows(capsys, "--model", str(vision_ckpt), *prompts)
    doc = bench_rows(capsys, "--model", str(vision_ckpt), *prompts, "--image", a, "--image", b)
    row, plain = doc["rows"][0] if "rows" in doc else doc, text["rows"][0] if "rows" in text else text
    soft = [x["soft_tokens"] for x in row["provenance"]["images"]]
    assert row["images_per_prompt"] == 2 and len(soft) == 2 and all(n > 0 for n in soft)
    assert row["image_tokens_per_prompt"] == sum(soft)
    assert row["images_encoded"] == 2 * row["completed"]  # every request's images ran through the tower
    assert 0 < row["mean_vision_ms"] <= row["mean_prefill_ms"]
    # the prompts the model saw carry the image tokens (and their begin/end marks)
    assert row["mean_input_len"] == plain["mean_input_len"] + sum(soft) + 2 * 2
    assert "mean_vision_ms" not in plain and "images_per_prompt" not in plain
    code, out, err = run(["bench", *FAST, "--model", str(vision_ckpt), *prompts, "--image", a], capsys)
    assert code == 0, err
    table = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| `")}
    assert "ms" in table["`mean_vision_ms`"] and "`image_tokens_per_prompt`" in table


@pytest.mark.parametrize("extra,needle", [
    (["--dummy", "26B-A4B", "--layers", "1"], "--dummy"),
    (["--base-url", "http://127.0.0.1:9/v1"], "--base-url"),
    (["--ray", "auto"], "--ray"),
    ([], "no vision tower"),  # the bundled model
], ids=["dummy", "base_url", "ray", "no_tower"])
def test_what_bench_cannot_honour_is_one_line(tmp_path, capsys, extra, needle):
    code, out, err = run(["bench", *FAST, *extra, "--image", picture(tmp_path / "a.png", 0)], capsys)
    assert code == 2 and out == "" and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("make,needle", [
    (lambda p: p.write_bytes(b"GIF89a nonsense"), "not a readable image"),
    (lambda p: None, "cannot read it"),
], ids=["not_an_image", "missing"])
def test_bad_image_files_are_one_line(vision_ckpt, tmp_path, capsys, make, needle):
    f = tmp_path / "x.png"
    make(f)
    code, out, err = run(["bench", *FAST, "--model", str(vision_ckpt), "--image", str(f)], capsys)
    assert code == 2 and out == "" and needle in err and err.count("\n") == 1, err
