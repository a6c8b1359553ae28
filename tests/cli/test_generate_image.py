"""`dgemma generate --image`: a checkpoint with a vision tower sees the image; one without says so in one line."""

import json

import pytest

from cli_run import run
from hf_oracle import write_picture as picture


def answer(capsys, ckpt, *images):
    args = ["generate", "--model", str(ckpt), "--format", "json", "--diffusion-steps", "4", "--blocks", "1",
            "--seed", "3"]
    code, out, err = run([*args, *[x for i in images for x in ("--image", i)], "describe"], capsys)
    assert code == 0, err
    return json.loads(out)["token_ids"]


def test_the_image_changes_the_answer_and_the_same_image_gives_the_same(vision_ckpt, tmp_path, capsys):
    a, b = picture(tmp_path / "a.png", 0), picture(tmp_path / "b.png", 1)
    first = answer(capsys, vision_ckpt, a)
    assert answer(capsys, vision_ckpt, a) == first
    assert answer(capsys, vision_ckpt, b) != first
    assert answer(capsys, vision_ckpt, a, b) not in (first, answer(capsys, vision_ckpt, b))


@pytest.mark.parametrize("make,needle", [
    (lambda p: p.write_bytes(b"GIF89a nonsense"), "not a readable image"),
    (lambda p: None, "cannot read it"),
], ids=["not_an_image", "missing"])
def test_bad_image_files_are_one_line_exit_2(vision_ckpt, tmp_path, capsys, make, needle):
    f = tmp_path / "x.png"
    make(f)
    code, out, err = run(["generate", "--model", str(vision_ckpt), "--image", str(f), "hi"], capsys)
    assert code == 2 and out == "" and needle in err and err.count("\n") == 1


def test_the_bundled_model_has_no_vision_tower(tmp_path, capsys):
    code, out, err = run(["generate", "--image", picture(tmp_path / "a.png", 0), "hi"], capsys)
    assert code == 2 and out == "" and "no vision tower" in err and err.count("\n") == 1


def test_jsonl_rows_carry_their_images(vision_ckpt, tmp_path, capsys):
    """A row's `images` (files next to the JSONL) give the answer `--image` gives; rows without images run as text."""
    a = picture(tmp_path / "a.png", 0)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "describe", "images": ["a.png"]}) + "\n"
                    + json.dumps({"prompt": "describe"}) + "\n")
    args = ["--model", str(vision_ckpt), "--format", "json", "--diffusion-steps", "4", "--blocks", "1", "--seed", "3"]
    code, out, err = run(["generate", *args, "--input-jsonl", str(rows), "--batch-size", "2"], capsys)
    assert code == 0, err
    got = [json.loads(line)["token_ids"] for line in out.splitlines()]
    assert got[0] == answer(capsys, vision_ckpt, a) and got[1] == answer(capsys, vision_ckpt)
    rows.write_text(json.dumps({"prompt": "describe", "images": ["missing.png"]}) + "\n")
    code, out, err = run(["generate", *args, "--input-jsonl", str(rows)], capsys)
    assert code == 2 and "row 1" in err and "missing.png" in err and err.count("\n") == 1


def test_an_image_row_follows_the_presets_thinking_as_image_does(vision_ckpt, tmp_path, capsys):
    a = picture(tmp_path / "a.png", 0)
    preset, rows = tmp_path / "think.yaml", tmp_path / "rows.jsonl"
    preset.write_text("thinking: true\n")
    rows.write_text(json.dumps({"prompt": "describe", "images": ["a.png"]}) + "\n")
    args = ["generate", "--model", str(vision_ckpt), "--preset", str(preset), "--format", "json", "--diffusion-steps",
            "4", "--blocks", "1", "--seed", "3"]
    got = []
    for more in (["--input-jsonl", str(rows)], ["--image", a, "describe"]):
        code, out, err = run([*args, *more], capsys)
        assert code == 0, err
        got.append({k: json.loads(out)[k] for k in ("prompt_tokens", "token_ids")})
    assert got[0] == got[1]


def test_info_counts_the_tower_in_the_weights_and_an_images_tokens(vision_ckpt, capsys):
    code, out, err = run(["info", "--model", str(vision_ckpt), "-f", "json"], capsys)
    assert code == 0, err
    card = json.loads(out)
    v = card["vision"]
    assert v["parameters"] > 0 and v["tokens_per_image"] > 0 and "loaded with the model" in v["note"]
    text_bytes = sum(card["bytes_by_dtype"].values())  # the text tensors as stored (fp32 here, as the model runs)
    assert card["memory"]["weights"] >= text_bytes + 4 * v["parameters"]


def test_watch_takes_images_as_generate_does(vision_ckpt, tmp_path, capsys):
    a = picture(tmp_path / "a.png", 0)
    args = ["--model", str(vision_ckpt), "--diffusion-steps", "4", "--blocks", "1", "--seed", "3", "--image", a,
            "describe"]
    code, watched, err = run(["watch", *args], capsys)
    assert code == 0, err
    code, generated, err = run(["generate", *args], capsys)
    assert code == 0, err
    assert watched.splitlines()[-1] == generated.splitlines()[-1]
