"""`dgemma generate --input-jsonl FILE --batch-size N` on the bundled model: results in input order with
their index and prompt, the same answers at every batch size, rows with their own seed and first canvas, and a
bad row stopping the run before anything runs."""

import json

import pytest

from cli_run import run
import dgcli

HELDOUT = dgcli.__path__[0] + "/data/prompts/heldout.jsonl"


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    rows = [json.loads(line) for line in open(HELDOUT)][::8]  # 12 rows over every family
    rows[1]["seed"] = 5
    rows[2]["init_canvas"] = "ids:1,2,3"
    f = tmp_path_factory.mktemp("batch") / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f, rows


def results(out):
    return [json.loads(line) for line in out.splitlines()]


def test_batch_sizes_give_the_same_results_in_input_order(prompt_file, capsys):
    f, rows = prompt_file
    code, out1, _ = run(["generate", "--input-jsonl", str(f), "--format", "json"], capsys)
    assert code == 0
    one = results(out1)
    code, out4, _ = run(["generate", "--input-jsonl", str(f), "--format", "json", "--batch-size", "4"], capsys)
    assert code == 0
    four = results(out4)
    assert [r["index"] for r in four] == list(range(len(rows)))
    assert [r["answer"] for r in four] == [r["answer"] for r in rows]  # pass-through keys stay on their row
    assert [r["prompt"] for r in four] == [r["prompt"] for r in rows]
    strip = lambda rs: [(r["text"], r["token_ids"], r["steps_per_block"], r["finish_reason"]) for r in rs]  # noqa: E731
    assert strip(four) == strip(one)
    assert sum(r["text"] == row["answer"] for r, row in zip(four, rows)) >= 9  # the bundled model answers them
    code, text, _ = run(["generate", "--input-jsonl", str(f), "--batch-size", "5"], capsys)
    assert code == 0 and text.splitlines() == [r["text"] for r in one]


def test_a_rows_seed_and_first_canvas_are_its_own(prompt_file, capsys, tmp_path):
    f, rows = prompt_file
    _, out, _ = run(["generate", "--input-jsonl", str(f), "--format", "json", "--batch-size", "3",
                     "--t-min", "1.5", "--t-max", "2.5", "--blocks", "1"], capsys)
    hot = results(out)
    for r, row in ((1, rows[1]), (2, rows[2])):
        argv = ["generate", "--format", "json", "--t-min", "1.5", "--t-max", "2.5", "--blocks", "1",
                "--seed", str(row.get("seed", 0)), row["prompt"]]
        if "init_canvas" in row:
            argv[1:1] = ["--init-canvas", row["init_canvas"]]
        _, solo, _ = run(argv, capsys)
        assert json.loads(solo)["token_ids"] == hot[r]["token_ids"], r
    plain = dict(rows[1])
    plain.pop("seed")
    g = tmp_path / "one.jsonl"
    g.write_text(json.dumps(plain) + "\n" + json.dumps(rows[1]) + "\n")
    _, out, _ = run(["generate", "--input-jsonl", str(g), "--format", "ndjson", "--batch-size", "2",
                     "--blocks", "1"], capsys)
    events = results(out)
    starts = {e["index"]: e["canvas"] for e in events if e["type"] == "block_start"}
    assert starts[0] != starts[1]  # seed 0 vs the row's seed 5: another first canvas
    assert {e["index"] for e in events if e["type"] == "step"} == {0, 1}
    assert [e["index"] for e in events if e["type"] == "result"] == [0, 1]


@pytest.mark.parametrize("bad,match", [
    ({"prompt": "Sort: 3 1", "temperature": 0.5}, "unknown key 'temperature'"),
    ({"prompt": "Sort: 3 1", "seed": -1}, "seed"),
    ({"prompt": "Sort: 3 1", "seed": "x"}, "seed 'x' is not a whole number"),
    ({"prompt": "Sort: 3 1", "init_canvas": list(range(5, 25))}, "the canvas holds 16"),
])
def test_a_bad_row_names_itself_before_anything_runs(bad, match, capsys, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "Reverse: a b c"}\n{"prompt": "Sort: 9 1 5"}\n' + json.dumps(bad) + "\n"
                 '{"prompt": "Reverse: x y"}\n')
    code, out, err = run(["generate", "--input-jsonl", str(f), "--format", "json", "--batch-size", "2"], capsys)
    assert code == 2
    assert out == ""  # every row is checked first (issue 23): a bad value no longer runs the rows before it
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "row 3 (index 2)" in lines[0] and match in lines[0], err


def test_bad_batch_size(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Reverse: a b"}\n')
    code, _, err = run(["generate", "--input-jsonl", str(f), "--batch-size", "0"], capsys)
    assert code == 2 and "--batch-size 0" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(["generate", "--batch-size", "4", "Reverse: a b"], capsys)
    assert code == 2 and "--input-jsonl" in err
