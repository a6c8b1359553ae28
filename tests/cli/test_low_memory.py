"""A GGUF model on a machine too small for it, at the command line: `info FILE.gguf` says what a run needs with
every weight resident and in low-memory mode, and per memory cap how many bytes a step reads from disk and the
step time that takes at a given (or measured) read rate; under a memory cap (a child cgroup of the memory
controller) too small even for low-memory mode, `bench` refuses before loading, in one line, exit 2 (before: it
loaded and the OOM killer ended it without a word)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_run import run
from dgcli.checkpoint.config import read_json
from dgcli.checkpoint.random_weights import write_random_gguf
from dgcli.runtime.preflight import _cgroup_folders
from dgcli.runtime.session import BUNDLED


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    """A Q4_K_M file of 4 layers of ~24 MB each (random blocks)."""
    raw = read_json(BUNDLED / "config.json")
    raw["text_config"].update(hidden_size=512, intermediate_size=512, moe_intermediate_size=512, num_experts=48,
                              top_k_experts=8, vocab_size=2048, num_hidden_layers=4, head_dim=128, global_head_dim=256,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"])
    path = tmp_path_factory.mktemp("lowmem") / "random-q4_k_m.gguf"
    write_random_gguf(raw, None, path, "q4_k_m")
    return path


def test_info_shows_the_low_memory_need_and_the_step_under_a_cap(q4_file, capsys):
    code, out, err = run(["info", str(q4_file), "--no-measure-peaks", "--format", "json", "--memory", "0.125",
                          "--read-rate", "50"], capsys)
    assert code == 0, err
    fit = json.loads(out)["gguf"]
    assert fit["need_low_memory"] < fit["need"]  # two layers resident, not four
    (cap,) = fit["caps"]
    assert cap["cap"] == 2**27 and cap["fits"]
    # A cap of 128 MiB keeps no layer beside a run's working set: every layer (their bytes in the kernels' form,
    # more than the file's Q4_K bytes) is read each step, at 50 MB/s
    assert 0.8 * fit["weights_loaded"] < cap["read_per_step"] <= fit["weights_loaded"]
    assert cap["step_s"] == pytest.approx(cap["read_per_step"] / 50e6)
    code, out, err = run(["info", str(q4_file), "--no-measure-peaks", "--memory", "0.125", "--read-rate", "50"],
                         capsys)
    assert "in low-memory mode (--low-memory" in out and "under a 128 MiB memory cap:" in out and "at 50 MB/s" in out
    code, out, err = run(["info", str(q4_file), "--no-measure-peaks", "--read-rate", "0"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--read-rate 0" in err


def capped(limit_bytes: int, argv: list[str]) -> subprocess.CompletedProcess:
    """argv run in a new child cgroup of this process's memory cgroup, capped at limit_bytes (v1 or v2)."""
    folders = _cgroup_folders()
    if os.geteuid() != 0 or not folders:
        pytest.skip("needs root and a memory cgroup to make a capped child cgroup")
    cg = folders[0] / f"dgemma-test-{os.getpid()}"
    try:
        cg.mkdir()
        limit = cg / ("memory.max" if (cg / "memory.max").exists() else "memory.limit_in_bytes")
        limit.write_text(str(limit_bytes))
    except OSError as e:
        pytest.skip(f"cannot make a capped child cgroup here ({e})")
    try:
        return subprocess.run(["sh", "-c", f'echo $$ > {cg / "cgroup.procs"} && exec "$@"', "sh", *argv],
                              capture_output=True, text=True, timeout=300)
    finally:
        cg.rmdir()


def test_a_cap_too_small_even_for_low_memory_mode_is_one_line_before_the_load(q4_file):
    exe = str(Path(sys.executable).parent / "dgemma")
    p = capped(200 << 20, [exe, "bench", "-m", str(q4_file), "--random-prompts", "--runs", "1", "--num-prompts", "1",
                           "--no-measure-peaks"])
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stderr.startswith("dgemma: error: ") and p.stderr.count("\n") == 1, p.stderr
    assert "even in low-memory mode" in p.stderr and "memory cap of 0.20 GiB" in p.stderr
