"""Issue 14, item 1: the block count follows the stated precedence (built-in < checkpoint < preset < flags),
so a plain `generate`/`bench` on the bundled model runs the checkpoint's 64-token budget (4 blocks of 16),
`--show-config` says so, a run that ends at the budget says it once on stderr, and `bench` reports
`quality` (exact match on the prompt file's answers, the definition sweep uses)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from dgcli.checkpoint.random_weights import REFERENCE_GENERATION_CONFIG, dummy_config
from dgcli.runtime.settings import resolve


def cli(*args: str, code: int = 0):
    from dgcli.cli import app

    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == code, (r.output, r.exception)
    return r


def test_show_config_gives_the_block_count_and_its_source():
    text = cli("generate", "--show-config").stdout
    assert re.search(r"^max_tokens\s+64\s+checkpoint$", text, re.M)
    assert re.search(r"^blocks\s+4\s+checkpoint: ceil\(max_tokens 64 / canvas 16\)$", text, re.M)
    doc = json.loads(cli("generate", "--show-config", "--format", "json").stdout)
    assert doc["blocks"] == {"value": 4, "source": "checkpoint", "rule": "ceil(max_tokens 64 / canvas 16)"}
    # A flag outranks the checkpoint: its block count wins whole (the checkpoint's budget no longer cuts).
    doc = json.loads(cli("generate", "--show-config", "--format", "json", "--blocks", "6").stdout)
    assert doc["blocks"]["value"] == 6 and doc["blocks"]["source"] == "flag" and doc["run"]["max_tokens"] is None
    assert "checkpoint's 64-token budget" in doc["blocks"]["rule"]
    doc = json.loads(cli("generate", "--show-config", "--format", "json", "--max-tokens", "20").stdout)
    assert doc["blocks"] == {"value": 2, "source": "flag", "rule": "ceil(max_tokens 20 / canvas 16)"}
    assert re.search(r"^blocks\s+4\s+checkpoint", cli("watch", "--show-config").stdout, re.M)  # watch: the same


def test_a_plain_generate_runs_the_checkpoints_budget():
    """The newcomer's `Count from 7 to 40.` used to stop at 22: one 16-token block."""
    r = cli("generate", "--format", "json", "Count from 7 to 40.")
    rec = json.loads(r.stdout)
    assert rec["settings"]["params"]["max_blocks"] == 0 and rec["settings"]["run"]["max_tokens"] == 64
    numbers = rec["text"].split()
    assert numbers[:16] == [str(n) for n in range(7, 23)]  # the first canvas
    assert len(numbers) > 16 and rec["blocks"] >= 2  # and it goes on past 22 into more blocks
    assert rec["finish_reason"] == "stop" and "note:" not in r.stderr


def test_the_budget_note_comes_once_per_run(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": "Count from 7 to 40."}) + "\n" for _ in range(3)), encoding="utf-8")
    r = cli("generate", "--input-jsonl", str(f), "--blocks", "1")
    assert len(r.stdout.splitlines()) == 3
    notes = [ln for ln in r.stderr.splitlines() if "budget" in ln]
    assert notes == ["dgemma: note: 3 of 3 answers ended at the 16-token budget (1 block of 16); "
                     "raise it with --max-tokens or --blocks"]
    r = cli("generate", "--max-tokens", "5", "Count from 7 to 40.")
    assert r.stdout.split() == ["7", "8", "9", "10", "11"]
    assert [ln for ln in r.stderr.splitlines() if "budget" in ln] == [
        "dgemma: note: the answer ended at the 5-token budget (1 block of 16); raise it with --max-tokens or --blocks"]


def _answers(prompts: list[str]) -> list[str]:
    """What the bundled model says to each prompt at the reference settings (the library path)."""
    import dgcli

    s = dgcli.open_session(settings={"device": "cpu"})
    return [dgcli.generate(s, p).text for p in prompts]


def test_bench_reports_quality_as_exact_match_on_the_answers(tmp_path):
    prompts = ["Reverse: c a t", "Sort: 7 2 9 2", "Count from 3 to 12.", "Continue: And God said"]
    said = _answers(prompts)
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": prompts[0], "answer": said[0]}, {"prompt": prompts[1], "answer": said[1]},
            {"prompt": prompts[2], "answer": said[2] + " 99"}, {"prompt": prompts[3]}]  # one wrong, one unanswered
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    base = ["bench", "--prompts", str(f), "--runs", "2", "--warmup", "0", "--no-measure-peaks"]
    row = json.loads(cli(*base, "--format", "json").stdout)["rows"][0]
    assert row["blocks"] == 4  # the checkpoint's budget, not one block
    assert row["quality_metric"] == "exact_match" and row["answered_prompts"] == 3
    assert row["quality"] == row["exact_match"] == pytest.approx(2 / 3)
    md = cli(*base[:3], "--runs", "1", "--warmup", "0", "--no-measure-peaks", "--verbose").stdout
    head = next(ln for ln in md.splitlines() if ln.startswith("| row 1 |"))
    assert "| 0.6667 |" in head  # quality sits in the headline table
    # Random-id prompts carry no answers: quality is null in JSON and n/a in the text printers.
    rand = ["bench", "--random-prompts", "--num-prompts", "1", "--random-input-len", "4", "--runs", "1",
            "--warmup", "0", "--no-measure-peaks", "--blocks", "1", "--diffusion-steps", "2"]
    row = json.loads(cli(*rand, "--format", "json").stdout)["rows"][0]
    assert row["quality"] is None and row["quality_metric"] is None
    md = cli(*rand, "--verbose").stdout
    assert re.search(r"^\| `quality` \| n/a \|", md, re.M)


def test_random_checkpoints_keep_the_released_budget_ratio(tmp_path):
    """One canvas of budget, as released (256 tokens on the 256 canvas), so tests of 8- and 16-token
    canvases still generate one block by default; the shipped 26B-A4B config keeps 256 on 256."""
    from dgcli.checkpoint.random_weights import write_random_checkpoint
    from hf_oracle import CLI_TEXT

    ck = write_random_checkpoint(tmp_path / "c", CLI_TEXT, canvas_length=8, tokenizer=False)
    gen = json.loads((ck / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == 8 and {k: v for k, v in gen.items() if k != "max_new_tokens"} == {
        k: v for k, v in REFERENCE_GENERATION_CONFIG.items() if k != "max_new_tokens"}
    assert resolve(gen, None, {}).blocks(8)["value"] == 1
    _, real_gen, _ = dummy_config("26B-A4B")
    assert real_gen["max_new_tokens"] == 256 and resolve(real_gen, None, {}).blocks(256)["value"] == 1
