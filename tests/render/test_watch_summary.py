"""`dgemma watch` ends with one summary line on stderr: blocks, denoising steps, ms per step and tokens per step;
a replay of its trace prints the recorded run's line. Through the CLI entry in this process, on the bundled
model."""

from __future__ import annotations

import json
import re

from cli_run import run

LINE = re.compile(r"^dgemma: (\d+) blocks?, (\d+) denoising steps?: ([\d.]+) ms per step, "
                  r"([\d.]+) tokens per step \(answer ids up to the stop id, padding excluded\)$")


def summary(err: str) -> re.Match:
    found = [m for m in map(LINE.match, err.splitlines()) if m]
    assert len(found) == 1, err
    return found[0]


def test_watch_ends_with_ms_and_tokens_per_step_live_and_replayed(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    code, out, err = run(["watch", "Count from 7 to 31.", "--blocks", "3", "--trace", str(trace)], capsys)
    assert code == 0 and out.strip(), err
    live = summary(err)
    done = [json.loads(ln) for ln in trace.read_text().splitlines()][-1]
    assert int(live.group(1)) == done["blocks"] and int(live.group(2)) == done["decoder_passes"]
    ms = done["timings"]["denoise_s"] / done["decoder_passes"] * 1e3
    assert abs(float(live.group(3)) - ms) <= 0.01 * ms and abs(float(live.group(4)) - done["tokens_per_forward"]) < 0.01
    assert err.strip().splitlines()[-1] == live.group(0)  # the last line: after the frames and notes
    code, out, err = run(["watch", "--replay", str(trace), "--speed", "0"], capsys)
    assert code == 0
    assert summary(err).group(0) == live.group(0)
