"""The CPU peaks behind the roofline floor, as a user meets them: bench's card shows their spread over the probes,
`--save-peaks FILE` pins one measurement and `--peaks FILE` reuses it (or a saved bench JSON) without measuring,
with the provenance saying so; a file for another CPU, thread count or matmul dtype is one error line; a machine
busier than its cores gets one warning line. Through the CLI entry in this process (cli_run.run)."""

from __future__ import annotations

import json
import os
import re

import pytest

from cli_run import forbid, run
from dgcli.measure import peaks

BENCH = ["bench", "--num-prompts", "1", "--runs", "1", "--warmup", "0", "--blocks", "1", "--diffusion-steps", "2"]
QUIET = (0.0, 0.0, 0.0)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """A load average below the cores unless a test says otherwise: the warning's test sets its own."""
    monkeypatch.setattr(os, "getloadavg", lambda: QUIET)


def one_error(code: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dgemma: error: "), (code, err)
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_bench_card_shows_each_measured_peak_with_its_spread(capsys):
    code, out, err = run(BENCH, capsys)
    assert code == 0, err
    row = next(ln for ln in out.splitlines() if "measured)" in ln)  # the CPU's row of the roofline table
    spread = re.findall(r"([\d.]+) ([GM])(?:FLOP|B)/s \(([\d.]+)-([\d.]+) over (\d+) probes\)", row)
    assert len(spread) == 2, row  # the matmul peak and the bandwidth, each with its min-max
    for median, _, lo, hi, n in spread:
        assert float(lo) <= float(median) * 1.01 and float(median) <= float(hi) * 1.01 and int(n) >= 3


def test_saved_peaks_are_pinned_without_measuring_again(tmp_path, capsys, monkeypatch):
    saved = tmp_path / "peaks.json"
    code, _, err = run(["info", "--save-peaks", str(saved)], capsys)
    assert code == 0 and f"--peaks {saved}" in err, err
    pinned = json.loads(saved.read_text())["peaks"]
    forbid(monkeypatch, [(peaks, "measure_cpu_peaks")], "--peaks FILE must not measure the peaks again")
    code, out, err = run([*BENCH, "--peaks", str(saved), "--format", "json"], capsys)
    assert code == 0, err
    row = json.loads(out)["rows"][0]
    assert row["peak_flops_per_s"] == pinned["flops_per_s"] and row["peak_bytes_per_s"] == pinned["bytes_per_s"]
    assert row["peak_flops_range"] == pinned["flops_range"]
    assert row["peaks_source"].startswith(f"pinned from {saved} (measured ")
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(out)
    code, out, err = run([*BENCH, "--peaks", str(bench_json)], capsys)  # a saved bench JSON pins them too
    assert code == 0, err
    assert "thread, pinned)" in out and f"{pinned['flops_per_s'] / 1e9:.4g} GFLOP/s" in out


def test_peaks_files_that_do_not_fit_are_one_error_line(tmp_path, capsys):
    saved = tmp_path / "peaks.json"
    assert run(["info", "--save-peaks", str(saved)], capsys)[0] == 0
    one_error(*run(["info", "--threads", "2", "--peaks", str(saved)], capsys)[::2], "measured on", "(2 threads)")
    one_error(*run(["info", "--dtype", "bfloat16", "--peaks", str(saved)], capsys)[::2], "float32", "bfloat16")
    one_error(*run([*BENCH, "--peaks", str(tmp_path / "none.json")], capsys)[::2], "no such file", "--save-peaks")
    (tmp_path / "bad.json").write_text("{not json")
    one_error(*run(["info", "--peaks", str(tmp_path / "bad.json")], capsys)[::2], "not a JSON file")
    (tmp_path / "other.json").write_text('{"rows": []}')
    one_error(*run(["info", "--peaks", str(tmp_path / "other.json")], capsys)[::2], "no measured CPU peaks")
    one_error(*run([*BENCH, "--peaks", str(saved), "--save-peaks", str(saved)], capsys)[::2], "give one of them")
    one_error(*run([*BENCH, "--no-measure-peaks", "--save-peaks", str(saved)], capsys)[::2], "--no-measure-peaks")
    one_error(*run([*BENCH, "--ray", "local", "--peaks", str(saved)], capsys)[::2], "--ray")
    one_error(*run(["bench", "--base-url", "http://127.0.0.1:9", "--peaks", str(saved)], capsys)[::2],
              "--peaks does not apply with --base-url")


def test_a_machine_busier_than_its_cores_gets_one_warning(capsys, monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 3.0, 1.0, 1.0))
    code, _, err = run(BENCH, capsys)
    warned = [ln for ln in err.splitlines() if "load average" in ln]
    assert code == 0 and len(warned) == 1, err
    assert f"{cores + 3.0:.2f} on {cores} core" in warned[0] and "--peaks" in warned[0]
    monkeypatch.setattr(os, "getloadavg", lambda: (cores - 0.5, 1.0, 1.0))
    code, _, err = run(BENCH, capsys)
    assert code == 0 and "load average" not in err
