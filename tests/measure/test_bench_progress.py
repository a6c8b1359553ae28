"""`dgemma bench` as a real process: a progress bar on stderr during the timed runs when stderr is a terminal (a
pty here), nothing of it when stderr is a pipe; the printed table carries the latency percentiles."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

ARGS = ["bench", "--num-prompts", "2", "--runs", "2", "--warmup", "0", "--blocks", "1", "--diffusion-steps", "2",
        "--no-measure-peaks"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm-256color", "COLUMNS": "120", "DGEMMA_DEBUG": ""}
CMD = [sys.executable, "-m", "dgcli.cli", *ARGS]


def test_timed_runs_show_a_progress_bar_on_a_terminal():
    main, side = pty.openpty()
    proc = subprocess.Popen(CMD, stdout=subprocess.PIPE, stderr=side, env=ENV)
    os.close(side)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the pty closes when the process ends
            break
        if not chunk:
            break
        seen += chunk
    out = proc.communicate(timeout=120)[0].decode()
    os.close(main)
    assert proc.returncode == 0, seen.decode(errors="replace")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))
    assert re.search(r"batch size 1 +run [12]/2", text), text  # what runs
    assert re.search(r"[0-4]/4 requests", text) and "ETA" in text, text  # the bar: requests of all runs, time left
    assert "\x1b[" not in out and "ETA" not in out  # stdout stays the report


def test_not_a_terminal_gets_no_progress_and_the_table_has_latency_percentiles():
    r = subprocess.run(CMD, capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ETA" not in r.stderr and "requests done" not in r.stderr and "\x1b[" not in r.stderr
    for key in ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms"):
        assert re.search(rf"^\| `{key}` \| [\d.]+ ms \|", r.stdout, re.M), (key, r.stdout)
