"""Bounded work per run (issue 33 item 1): every setting that sizes work has an upper bound (`params.LIMITS`),
refused in one line before a checkpoint is loaded, by every settings source (flags, presets, sweep cells);
and the engine computes a request's temperature schedule step by step, never its whole length up front."""

from __future__ import annotations

import time

import pytest
import torch
from cli_run import forbid, run

from dgcli.cli.options import sampler_flags
from dgcli.errors import UserError
from dgcli.checkpoint import load as loader
from dgcli.runtime.session import open_session
from dgcli.runtime.settings import RunSettings, resolve
from dgcli.sampling import rules
from dgcli.engine import LLMEngine as Engine, Request
from dgcli.sampling.events import Step
from dgcli.sampling.params import LIMITS, DiffusionEbParams

HUGE = {  # flag -> (value, the key its message names)
    "--diffusion-steps": (10**9, "max_denoising_steps"),
    "--stability-threshold": (10**9, "stability_threshold"),
    "--blocks": (10**12, "max_blocks"),
    "--max-tokens": (10**12, "max_tokens"),
}


def refused(argv, capsys, monkeypatch, key, value):
    """`dgemma generate ARGV` exits 2 at once with one line naming `key`, its bound and a fix, having loaded
    no weights."""
    forbid(monkeypatch, [(loader, "load_model")], "weights loaded before an out-of-bounds setting was refused")
    t0 = time.perf_counter()
    code, out, err = run(["generate", *argv], capsys, monkeypatch=monkeypatch)
    assert time.perf_counter() - t0 < 10
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"dgemma: error: {key}={value}: at most {LIMITS[key].bound} "), err
    assert "to e.g." in lines[0], err  # names a fix
    return lines[0]


@pytest.mark.parametrize("flag", list(HUGE))
def test_cli_flag_over_its_bound_exits_2_in_one_line(flag, capsys, monkeypatch):
    value, key = HUGE[flag]
    refused([flag, str(value), "Reverse: c a t"], capsys, monkeypatch, key, value)


def test_cli_preset_over_its_bound_exits_2_naming_the_file(capsys, monkeypatch, tmp_path):
    preset = tmp_path / "huge.yaml"
    preset.write_text("max_denoising_steps: 1000000000\n")
    line = refused(["--preset", str(preset), "Reverse: c a t"], capsys, monkeypatch, "max_denoising_steps", 10**9)
    assert "from preset" in line and "huge.yaml" in line


def test_cli_input_jsonl_over_its_bound_exits_2(capsys, monkeypatch, tmp_path):
    # JSONL rows carry only prompt, seed and init_canvas (seeds are bounded: tests/cli/test_batch_generate.py);
    # the file's sampler settings come from flags and presets, refused before any row runs.
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Reverse: c a t"}\n')
    refused(["--input-jsonl", str(rows), "--diffusion-steps", str(10**9)], capsys, monkeypatch,
            "max_denoising_steps", 10**9)


@pytest.mark.parametrize("key", ["max_denoising_steps", "stability_threshold", "max_blocks", "max_tokens"])
def test_every_bound_is_inclusive_and_its_fix_resolves(key):
    bound = LIMITS[key].bound
    resolve(None, None, {key: bound})  # the bound itself is allowed
    with pytest.raises(UserError) as e:
        resolve(None, None, {key: bound + 1})
    msg = str(e.value)
    assert msg.startswith(f"{key}={bound + 1}: at most {bound} {LIMITS[key].unit}; set {key} (") and "\n" not in msg
    fix = msg.split(" to e.g. ")[1].split(" ")[0]
    resolve(None, None, {key: fix})  # the suggested value is valid


def test_sweep_cells_and_direct_construction_get_the_bounds():
    with pytest.raises(UserError, match=r"^max_denoising_steps=5000: at most 4096"):
        DiffusionEbParams().replace(max_denoising_steps=5000)  # a sweep cell
    with pytest.raises(UserError, match=r"^stability_threshold=257: at most 256"):
        DiffusionEbParams.check(DiffusionEbParams(stability_threshold=257))  # what the loop runs
    with pytest.raises(UserError, match=r"^max_tokens=1048577: at most 1048576 tokens"):
        RunSettings(max_tokens=2**20 + 1).validate()


# ---- the engine: the schedule is computed as the steps run ------------------------------------------------


@pytest.fixture(scope="module")
def session():
    return open_session(None, None, sampler_flags(device="cpu", dtype="float32"))


@pytest.mark.parametrize("lag", [0, 1])
def test_submit_does_not_build_the_schedule_up_front(session, lag):
    # The engine does not validate (its callers do), so its own cost must not grow with the step cap: the old
    # submit built all N temperatures (about 40 us each), i.e. seconds here; now it builds none.
    n = 200_000
    params = DiffusionEbParams(max_denoising_steps=n, confidence_threshold=0.0, seed=3)
    engine = Engine(session.model, slots=1, max_len=64, pad_id=session.pad_id, lag=lag)
    t0 = time.perf_counter()
    engine.submit(Request(id=0, prompt=torch.tensor([2, 5, 6, 7]), params=params, num_blocks=1, seed=3))
    assert time.perf_counter() - t0 < 0.5
    steps = []
    for ev in engine.events():
        if isinstance(ev, Step):
            steps.append(ev)
        if len(steps) == 3:
            break
    assert [s.step for s in steps] == [1, 2, 3] and all(s.max_steps == n for s in steps)
    # The reference's T_n for n = N, N-1, N-2 (first step t_max), with the same float ops.
    assert [s.temperature for s in steps] == [rules.temperature(n - i, n, params.t_min, params.t_max) for i in range(3)]


def test_the_lazy_schedule_is_bit_identical_to_the_whole_one():
    n = LIMITS["max_denoising_steps"].bound
    p = DiffusionEbParams(max_denoising_steps=n, t_min=0.3, t_max=0.9)
    r = Request(id=0, prompt=torch.tensor([1]), params=p, num_blocks=1, seed=0)
    whole = [rules.temperature(i, n, p.t_min, p.t_max) for i in range(n, 0, -1)]  # what submit used to build
    assert [r.temperature(i) for i in range(n)] == whole
