"""`dgemma generate --input-jsonl FILE --format json -o OUT [--resume]`: the records go to OUT, in input order,
as stdout would carry them; a run cut short (a kill, every Ray worker gone) keeps what it wrote, and --resume
runs only the rows OUT lacks, refusing a file written for other prompts or settings."""

import json

import pytest

from cli_run import run
import dgcli

HELDOUT = dgcli.__path__[0] + "/data/prompts/heldout.jsonl"


def records(text: str) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "timings"} for line in text.splitlines()]


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    rows = [json.loads(line) for line in open(HELDOUT)][::20][:5]
    f = tmp_path_factory.mktemp("out") / "five.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


@pytest.fixture(scope="module")
def stdout_run(five):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dgcli.cli", "generate", "--input-jsonl", str(five), "--format", "json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_output_holds_what_stdout_would(five, stdout_run, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    code, printed, _ = run(["generate", "--input-jsonl", str(five), "--format", "json", "-o", str(out)], capsys)
    assert code == 0 and printed == ""
    assert records(out.read_text()) == records(stdout_run)


def test_resume_runs_only_the_missing_rows(five, stdout_run, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    lines = stdout_run.splitlines()
    out.write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])  # two whole records, then one cut short by a kill
    code, printed, err = run(["generate", "--input-jsonl", str(five), "--format", "json", "-o", str(out), "--resume"],
                             capsys)
    assert code == 0 and printed == "", err
    assert "2 of 5 record(s) already in" in err and "3 to run" in err
    assert records(out.read_text()) == records(stdout_run)  # each record once, in input order


@pytest.mark.parametrize("extra, words", [
    ([], "exists: add --resume"),  # never appended to by accident
    (["--resume", "--seed", "3"], "another prompt or other settings"),  # a file of another run
    (["--resume", "--format", "text"], "--format json"),
])
def test_a_file_that_cannot_be_continued_is_one_line_and_stays(five, stdout_run, tmp_path, capsys, extra, words):
    out = tmp_path / "out.jsonl"
    out.write_text(stdout_run)
    argv = ["generate", "--input-jsonl", str(five), "--format", "json", "-o", str(out), *extra]
    code, printed, err = run(argv, capsys)
    assert code == 2 and printed == "" and len(err.strip().splitlines()) == 1 and words in err, err
    assert out.read_text() == stdout_run


def test_resume_needs_the_file(five, capsys):
    code, _, err = run(["generate", "--input-jsonl", str(five), "--format", "json", "--resume"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "-o FILE" in err
