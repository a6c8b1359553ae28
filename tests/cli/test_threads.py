"""Issue 14, item 3: one thread rule for every command (generate, watch, bench, sweep, info), `--threads N`
on each, the count and its source in the card and in provenance; the CPU peaks are measured several times
and reported as a median with their spread."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dgcli.errors import UserError
from dgcli.measure import cost as info
from dgcli.measure import peaks
from dgcli.runtime import session as sess

RULE_SMALL = "rule: a CPU model under 50 M parameters runs on 1 thread"


@pytest.fixture(autouse=True)
def _threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def cli(*args: str):
    from dgcli.cli import app

    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, (r.output, r.exception)
    return r


def test_the_rule(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert sess.thread_rule(3_746_040, "cpu") == (1, RULE_SMALL)
    n, why = sess.thread_rule(25_000_000_000, "cpu")
    assert n == sess.TORCH_DEFAULT_THREADS and why.startswith("rule: torch's default")
    assert sess.thread_rule(3_746_040, "cuda")[0] == sess.TORCH_DEFAULT_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert sess.thread_rule(3_746_040, "cpu") == (3, "env: OMP_NUM_THREADS=3")
    assert sess.thread_rule(3_746_040, "cpu", 2) == (2, "flag: --threads 2")  # the flag wins over everything
    with pytest.raises(UserError, match="--threads 0: must be >= 1"):
        sess.thread_rule(1, "cpu", 0)


def test_bench_prints_the_thread_count_and_source_in_card_and_provenance(monkeypatch, cli_ckpt):
    base = ["bench", "--model", str(cli_ckpt), "--random-prompts", "--num-prompts", "1", "--random-input-len", "4",
            "--runs", "1", "--warmup", "0", "--no-measure-peaks", "--diffusion-steps", "2", "--format", "json"]
    doc = json.loads(cli(*base, "--threads", "2").stdout)
    prov = doc["rows"][0]["provenance"]
    assert (prov["torch_threads"], prov["threads_source"]) == (2, "flag: --threads 2")
    assert doc["card"]["threads"] == {"count": 2, "source": "flag: --threads 2"}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the tests set it; a user usually has not
    r = cli(*base[:-2], "--format", "md", "--verbose")
    assert f"**threads**: 1 ({RULE_SMALL})" in r.stdout
    assert "- torch_threads: 1" in r.stdout and f"- threads_source: {RULE_SMALL}" in r.stdout


def test_every_model_command_takes_threads_and_info_follows_the_same_rule(monkeypatch, cli_ckpt):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    card = json.loads(cli("info", "--no-measure-peaks", "--format", "json").stdout)
    assert card["threads"] == {"count": 1, "source": RULE_SMALL}  # the bundled model, as bench runs it
    card = json.loads(cli("info", "--threads", "2", "--no-measure-peaks", "--format", "json").stdout)
    assert card["threads"]["count"] == 2 and torch.get_num_threads() == 2
    cli("generate", "--model", str(cli_ckpt), "--diffusion-steps", "2", "--threads", "2", "hi")
    assert torch.get_num_threads() == 2
    cli("watch", "--model", str(cli_ckpt), "--diffusion-steps", "2", "--threads", "1", "hi")
    assert torch.get_num_threads() == 1
    for cmd in ("generate", "watch", "bench", "sweep", "info"):
        assert "--threads" in cli(cmd, "--help").stdout, cmd


def test_cpu_peaks_are_a_median_with_their_spread():
    peaks._measured.clear()
    torch.set_num_threads(1)
    p = info.measure_cpu_peaks(seconds=0.2, repeats=3)
    assert p.repeats == 3 and "(1 thread)" in p.name and "median of 3 rounds" in p.source
    assert p.flops_range[0] <= p.flops_per_s <= p.flops_range[1]
    assert p.bytes_range[0] <= p.bytes_per_s <= p.bytes_range[1]
    assert info.measure_cpu_peaks() is p  # cached for this thread count
    from dgcli.measure.bench import peaks_for_card
    from dgcli.measure.printers import card_markdown
    from dgcli.checkpoint.load import load_config
    from dgcli.runtime.session import BUNDLED

    c = info.card(load_config(BUNDLED), name="t", source="s", dtype="float32", peaks=peaks_for_card(p))
    assert c["devices"][0]["flops_range"] == list(p.flops_range) or c["devices"][0]["flops_range"] == p.flops_range
    assert " over 3 probes)" in card_markdown(c)
