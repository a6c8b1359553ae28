"""`dgemma sweep`: a real process interrupted mid-sweep and resumed holds every cell exactly once; the
frontier on hand-built rows; the row file's torn-line recovery; grid errors as one line; quality by
exact match and by agreement; the plot."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from dgcli.measure import metrics
from dgcli.measure import sweep as sw
from dgcli.errors import UserError
from dgcli.sampling.params import DiffusionEbParams



@pytest.fixture(scope="module")
def ckpt(cli_ckpt):
    return cli_ckpt


def cli(*args, code=0):
    from dgcli.cli import app

    r = CliRunner().invoke(app, ["sweep", *args])
    assert r.exit_code == code, (r.output, r.exception)
    return r


def cells_in(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if json.loads(ln).get("kind") == "cell"]


# ---- kill and resume (the one real subprocess) ----------------------------------------------------------


def test_interrupted_sweep_resumes_with_each_cell_once(ckpt, tmp_path):
    out = tmp_path / "s.jsonl"
    args = ["--model", str(ckpt), "--random-prompts", "--num-prompts", "2", "--random-input-len", "8",
            "--diffusion-steps", "4-24+2", "--blocks", "2", "--warmup", "0", "--runs", "1", "--no-measure-peaks",
            "-o", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DGEMMA_DEBUG="")
    proc = subprocess.Popen([sys.executable, "-c", "from dgcli.cli import main; main()", "sweep", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and len(cells_in(out)) >= 1:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the sweep ended before it could be interrupted: " + proc.stderr.read()[-500:]
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-800:]
    assert "--resume" in err and "Traceback" not in err
    first = cells_in(out)
    assert 1 <= len(first) < 11  # 4, 6, ..., 24: 11 cells

    with pytest.raises(AssertionError):  # without --resume an existing file is refused
        cli(*args)
    r = cli(*args, "--resume", "--format", "jsonl")
    rows = cells_in(out)
    keys = [r["cell_key"] for r in rows]
    assert len(keys) == len(set(keys)) == 11
    assert sorted(r["cell"]["max_denoising_steps"] for r in rows) == list(range(4, 25, 2))
    assert rows[: len(first)] == first  # finished rows were kept as they were
    refs = [json.loads(ln) for ln in out.read_text().splitlines() if json.loads(ln).get("kind") == "reference"]
    assert len(refs) == 1 and len(refs[0]["outputs"]) == 2  # the reference ran once, before the kill
    assert len(r.stdout.splitlines()) == 11  # --format jsonl: the final rows
    again = cli(*args, "--resume")  # nothing left to run
    assert "nothing left to run" in again.stderr and len(cells_in(out)) == 11


# ---- pieces -----------------------------------------------------------------------------------------------


def test_pareto_frontier_on_hand_built_rows():
    """Cells measured apart (points, two passes each): the frontier is the classic Pareto one."""
    rows = [{"id": "a", "s": 10, "q": 0.9}, {"id": "b", "s": 20, "q": 0.8}, {"id": "c", "s": 15, "q": 0.7},
            {"id": "d", "s": 30, "q": 0.5}, {"id": "e", "s": 5, "q": 0.9}, {"id": "f", "s": 30, "q": 0.5},
            {"id": "g", "s": 25, "q": None}, {"id": "h", "s": 1, "q": 1.0}]
    front = sw.separated_frontier([dict(r, spread_passes=2) for r in rows], "s", "q")
    # c loses to b; e to a (same quality, slower); g has no quality; d and f tie and are both kept.
    assert [r["id"] for r in front] == ["h", "a", "b", "d", "f"]
    assert sw.separated_frontier([], "s", "q") == []


def test_bad_grid_spec_is_one_line(ckpt):
    from dgcli.cli import app

    for args in (["--diffusion-steps", "8-4+2"], ["--entropy-bound", "0.1,,0.2"], ["--t-min", "abc"],
                 ["--blocks", "1.5"], ["--seeds", "x"], ["--plot", "f.pdf"]):
        r = CliRunner().invoke(app, ["sweep", "--model", str(ckpt), *args, "--dry-run"])
        assert isinstance(r.exception, UserError), (args, r.output)
        msg = str(r.exception)
        assert "\n" not in msg and ("--" in msg), msg


def test_plan_skips_impossible_cells_and_dry_run_loads_nothing(ckpt, tmp_path):
    axes = sw.parse_axes({"t_min": "0.2,0.6", "t_max": "0.4,0.8", "max_blocks": None})
    cells, skipped = sw.plan(DiffusionEbParams(), axes)
    assert [c.values for c in cells] == [{"t_min": 0.2, "t_max": 0.4}, {"t_min": 0.2, "t_max": 0.8},
                                         {"t_min": 0.6, "t_max": 0.8}]
    assert skipped[0][0] == {"t_min": 0.6, "t_max": 0.4} and "t_max" in skipped[0][1]
    r = cli("--model", str(ckpt), "--diffusion-steps", "4,8", "--entropy-bound", "0.1-0.3+0.1", "--dry-run",
            "-o", str(tmp_path / "x.jsonl"))
    assert "plan: 6 cell(s)" in r.stdout and "steps=8 eb=0.3" in r.stdout
    assert not (tmp_path / "x.jsonl").exists()


def test_row_store_drops_a_torn_last_line(tmp_path):
    store = sw.RowStore(tmp_path / "r.jsonl")
    store.append({"kind": "cell", "cell_key": "a"})
    store.append({"kind": "cell", "cell_key": "b"})
    with open(store.path, "a") as f:
        f.write('{"kind": "cell", "cell_ke')  # killed mid-write
    notes = []
    assert [r["cell_key"] for r in store.load(notes.append)] == ["a", "b"] and notes
    assert store.path.read_text().count("\n") == 2 and store.load() == store.load()
    store.path.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(UserError, match="line 2"):
        store.load()


def test_agreement_and_exact_match():
    assert sw.agreement([1, 2, 3], [1, 2, 3]) == 1
    assert sw.agreement([1, 9, 3, 4], [1, 2, 3]) == 0.5  # 2 equal positions over the longer length 4
    assert sw.agreement([], []) == 1
    assert sw.exact_match(" 2 3 \n", "2 3") and not sw.exact_match("2 3 4", "2 3")


def test_exact_match_quality_from_answers(ckpt, tmp_path):
    """Answers in the prompt file make quality an exact match: one prompt's answer is what the model
    says at the cell's settings (run here through the same sampler), the other's is not."""
    import dgcli
    from dgcli.engine import generate
    from dgcli.text.tokenizer import load_tokenizer

    tok, model = load_tokenizer(ckpt), dgcli.load_model(ckpt)
    params = DiffusionEbParams(max_denoising_steps=3, seed=0, max_blocks=1)
    ids = tok.encode_prompt("The quick brown fox")
    done = generate(model, ids, params=params, num_blocks=1, stop_ids=[1, 106, 50], pad_id=tok.pad_id)
    said = tok.answer_text(done.token_ids, stop_ids=[1, 106, 50])
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "The quick brown fox", "answer": said}) + "\n"
                 + json.dumps({"prompt": "jumps over", "answer": said + " not this"}) + "\n")
    out = tmp_path / "q.jsonl"
    cli("--model", str(ckpt), "--prompts", str(f), "--diffusion-steps", "3,4", "--blocks", "1", "--warmup", "0",
        "--runs", "1", "--no-measure-peaks", "-o", str(out), "--plot", str(tmp_path / "p.svg"))
    rows = {r["cell"]["max_denoising_steps"]: r for r in cells_in(out)}
    assert rows[3]["quality_metric"] == "exact_match" and rows[3]["exact_match"] == 0.5
    assert 0 <= rows[4]["quality"] <= 0.5
    svg = ET.parse(tmp_path / "p.svg").getroot()
    assert svg.tag.endswith("svg") and len([e for e in svg.iter() if e.tag.endswith("circle")]) >= 2


def test_resume_refuses_a_different_sweep(ckpt, tmp_path):
    out = tmp_path / "d.jsonl"
    base = ["--model", str(ckpt), "--random-prompts", "--num-prompts", "1", "--random-input-len", "4",
            "--diffusion-steps", "2,3", "--warmup", "0", "--runs", "1", "--no-measure-peaks", "-o", str(out)]
    cli(*base)
    from dgcli.cli import app

    r = CliRunner().invoke(app, ["sweep", *base, "--resume", "--t-max", "0.9"])
    assert isinstance(r.exception, UserError) and "different sweep" in str(r.exception)
    r = cli(*base, "--resume", "--diffusion-steps", "2,3,5")  # a wider grid runs only the new cell
    assert "1 to run" in r.stderr and len(cells_in(out)) == 3


def test_svg_frontier_plot(tmp_path):
    rows = [{"cell": {"max_denoising_steps": s}, "cell_key": str(s), "v": 100 / s, "quality": min(1, s / 32),
             "spread_passes": 2} for s in (4, 8, 16, 32, 48)]
    front = sw.separated_frontier(rows, "v", "quality")
    p = sw.write_plot(tmp_path / "f.svg", rows, front, "v", "quality", title="t",
                      label=lambda r: sw.cell_label(r, ["max_denoising_steps"]))
    root = ET.parse(p).getroot()
    poly = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(poly) == 1 and len(poly[0].get("points").split()) == len(front) == 4  # 48 is dominated by 32
    with pytest.raises(UserError, match=".svg or .png"):
        sw.write_plot(tmp_path / "f.pdf", rows, front, "v", "quality", title="t", label=str)


# ---- spread per cell and overlapping frontier points (issue 14, item 3) ------------------------------------


def _row(key, speed, lo, hi, q, qlo=None, qhi=None):
    return {"cell": {"max_denoising_steps": key}, "cell_key": str(key), "v": speed, "quality": q,
            "spread": {"v": [lo, hi], "quality": [q if qlo is None else qlo, q if qhi is None else qhi]}}


def test_frontier_points_whose_intervals_overlap_are_marked():
    rows = [_row(8, 300, 290, 310, 0.80), _row(16, 250, 240, 295, 0.90),  # 16's speed reaches into 8's
            _row(32, 150, 140, 160, 0.95), _row(48, 100, 95, 105, 0.96, 0.95, 0.97)]  # quality ties 32's
    over = sw.frontier_overlaps(rows, "v", "quality")
    assert over["8"] == [{"max_denoising_steps": 16}] and over["16"] == [{"max_denoising_steps": 8}]
    assert over["32"] == [{"max_denoising_steps": 48}] and over["48"] == [{"max_denoising_steps": 32}]
    apart = [_row(8, 300, 290, 310, 0.80), _row(32, 150, 140, 160, 0.95)]
    assert sw.frontier_overlaps(apart, "v", "quality") == {"8": [], "32": []}
    # A row without a spread counts as the point it is.
    assert sw.interval({"v": 3.0}, "v") == (3.0, 3.0) and sw.interval({}, "v") is None


def test_sweep_text_names_no_winner_inside_the_spread(capsys):
    """8's speed lead over 16 lies inside their overlapping intervals: it crowns nothing, so 16 (better quality,
    speed not told apart) holds the frontier and 8 is off it; 32 is slower beyond doubt and better: a trade-off."""
    from dgcli.cli.sweep import _finish

    rows = [dict(_row(8, 300, 290, 310, 0.80), kind="cell"), dict(_row(16, 250, 240, 295, 0.90), kind="cell"),
            dict(_row(32, 150, 140, 160, 0.95), kind="cell")]
    for r in rows:
        r["spread_passes"] = 3
    cells = [sw.Cell(r["cell"], DiffusionEbParams(), r["cell_key"]) for r in rows]
    _finish(rows, cells, {"max_denoising_steps": [8, 16, 32]}, "v", None, "md", {}, "f.jsonl")
    out = capsys.readouterr().out
    assert "| v [min, max] | quality [min, max] |" in out
    assert "| steps=8 | 8 | 300 [290, 310] | 0.8 [0.8, 0.8] |" in out and out.count("| * |") == 2
    assert "| steps=8 | 8 | 300 [290, 310] | 0.8 [0.8, 0.8] | - | - | - | - | - | - |  |" in out  # off the frontier
    assert "- steps=16: v 250 [240, 295], quality 0.9 [0.9, 0.9]\n" in out
    assert "- steps=32: v 150 [140, 160], quality 0.95 [0.95, 0.95]\n" in out
    head = json.loads(out.strip().splitlines()[-1])
    assert [f["max_denoising_steps"] for f in head["frontier"]] == [32, 16]
    assert [f["ties"] for f in head["frontier"]] == [[], []] and head["frontier"][0]["v_interval"] == [140, 160]


def test_cells_measured_once_or_inside_each_others_spread_are_a_tie():
    once = [{"cell": {"s": 8}, "cell_key": "8", "v": 196.4, "quality": 0.9, "spread_passes": 1},
            {"cell": {"s": 16}, "cell_key": "16", "v": 194.5, "quality": 0.9, "spread_passes": 1}]
    front = sw.separated_frontier(once, "v", "quality")
    assert len(front) == 2 and sw.frontier_ties(front, "v", "quality") == {"8": [{"s": 16}], "16": [{"s": 8}]}
    apart = [dict(_row(8, 300, 290, 310, 0.9), spread_passes=3), dict(_row(16, 200, 190, 210, 0.9), spread_passes=3)]
    assert [r["cell_key"] for r in sw.separated_frontier(apart, "v", "quality")] == ["8"]  # beyond the spread
    inside = [dict(_row(8, 300, 250, 310, 0.9), spread_passes=3), dict(_row(16, 280, 270, 290, 0.9), spread_passes=3)]
    front = sw.separated_frontier(inside, "v", "quality")
    assert len(front) == 2 and all(sw.frontier_ties(front, "v", "quality").values())
    # quality is not timed: one pass tells 0.9 from 0.8, so the faster-measured 0.8 cell is off the frontier
    mixed = [dict(once[0], quality=0.8), once[1]]
    assert [r["cell_key"] for r in sw.separated_frontier(mixed, "v", "quality")] == ["16"]


def test_a_sweep_of_identical_work_run_once_is_a_tie_on_axes_from_zero(ckpt, tmp_path):
    """Batch sizes 1 and 2 over one prompt do the same work with the same answers: one run each can only
    measure noise between them, so neither is starred; the plot's axes start at 0 and carry units."""
    out, svg = tmp_path / "t.jsonl", tmp_path / "t.svg"
    r = cli("--model", str(ckpt), "--random-prompts", "--num-prompts", "1", "--random-input-len", "4",
            "--diffusion-steps", "2", "--blocks", "1", "--batch-size", "1,2", "--warmup", "0", "--runs", "1",
            "--no-measure-peaks", "-o", str(out), "--plot", str(svg))
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("| batch=")]
    assert len(table) == 2 and all(ln.endswith("| tie |") for ln in table), r.stdout
    assert "one timed pass per cell measures no spread" in r.stdout
    head = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(head["frontier"]) == 2 and all(f["ties"] for f in head["frontier"])
    texts = {(e.get("text-anchor"), e.text) for e in ET.parse(svg).getroot().iter() if e.tag.endswith("text")}
    ticks_x = [t for a, t in texts if a == "middle" and t and re.fullmatch(r"[\d.e+-]+", t)]
    ticks_y = [t for a, t in texts if a == "end"]
    assert "0" in ticks_x and "0" in ticks_y, texts
    assert ("middle", "output_throughput [tok/s]") in texts and ("middle", "quality [share, 0-1]") in texts


def test_each_cell_has_a_spread_over_seeds_and_runs(ckpt, tmp_path):
    out = tmp_path / "r.jsonl"
    r = cli("--model", str(ckpt), "--random-prompts", "--num-prompts", "1", "--random-input-len", "4",
            "--diffusion-steps", "2,3", "--seeds", "0,1", "--runs", "2", "--warmup", "0", "--no-measure-peaks",
            "-o", str(out))
    rows = cells_in(out)
    assert len(rows) == 2
    for row in rows:
        assert row["spread_passes"] == 4 and row["runs"] == 2 and row["seeds"] == [0, 1]
        lo, hi = row["spread"]["output_throughput"]
        assert lo <= row["output_throughput"] <= hi
        assert set(metrics.SPREAD_KEYS) | {"quality"} == set(row["spread"])
        qlo, qhi = row["spread"]["quality"]  # agreement per pass, against the reference setting
        assert 0 <= qlo <= row["quality"] <= qhi <= 1
    assert "output_throughput [min, max]" in r.stdout and "over each cell's 4 timed passes" in r.stdout


# ---- the default row file: one per run (issue 23, item 7) ----------------------------------------------------


def test_default_row_file_is_new_per_run(tmp_path):
    now = time.mktime((2026, 11, 25, 18, 30, 12, 0, 0, -1))
    assert sw.fresh_row_file(tmp_path, now).name == "sweep-20261125-183012.jsonl"
    (tmp_path / "sweep-20261125-183012.jsonl").touch()
    (tmp_path / "sweep-20261125-183012-2.jsonl").touch()
    assert sw.fresh_row_file(tmp_path, now).name == "sweep-20261125-183012-3.jsonl"


def test_two_sweeps_in_a_row_without_output_do_not_collide(ckpt, tmp_path, monkeypatch):
    """The README's sweeps one after another in one directory: each writes its own file and names it on
    stderr at the start and the end; --resume without -o says which flag names the file."""
    monkeypatch.chdir(tmp_path)
    args = ["--model", str(ckpt), "--random-prompts", "--num-prompts", "1", "--random-input-len", "4",
            "--diffusion-steps", "2", "--warmup", "0", "--runs", "1", "--no-measure-peaks"]
    errs = [cli(*args).stderr, cli(*args).stderr]
    files = sorted(p.name for p in tmp_path.glob("sweep-*.jsonl"))
    assert len(files) == 2 and not (tmp_path / "sweep.jsonl").exists()
    for err in errs:
        named = [ln for ln in err.splitlines() if ln.startswith("dgemma: sweep rows in ")]
        assert len(named) == 2 and named[0] == named[1]  # at the start and at the end
        name = named[0].split()[4]
        assert name in files and f"(resume with -o {name} --resume)" in named[0]
        assert len(cells_in(tmp_path / name)) == 1
    from dgcli.cli import app

    r = CliRunner().invoke(app, ["sweep", *args, "--resume"])
    assert isinstance(r.exception, UserError) and any(f"-o {f}" in str(r.exception) for f in files)
    r = CliRunner().invoke(app, ["sweep", *args, "-o", files[0]])  # -o keeps today's rule
    assert isinstance(r.exception, UserError) and "add --resume" in str(r.exception)
    assert "rows go to a new sweep-" in cli(*args, "--dry-run").stdout  # named when a run starts: none made
    assert sorted(p.name for p in tmp_path.glob("sweep-*.jsonl")) == files


# ---- checks before any measuring: the plot's and the row file's places, each cell's own settings --------


@pytest.fixture
def nothing_opened(monkeypatch):
    """Opening the model fails the test: the checks must come before any measuring."""
    from cli_run import forbid
    from dgcli.runtime import session

    forbid(monkeypatch, ((session, "open_any"),), "the model was opened before the sweep's flags were checked")


FAST = ["--diffusion-steps", "2,4", "--runs", "1", "--num-prompts", "2", "--warmup", "0", "--no-measure-peaks"]


def one_line(r, *words):
    assert isinstance(r.exception, UserError), (r.output, r.exception)  # main() makes it exit 2
    msg = str(r.exception)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def test_plot_and_output_places_are_checked_before_measuring(ckpt, tmp_path, nothing_opened):
    from dgcli.cli import app

    def run(*args):
        return CliRunner().invoke(app, ["sweep", "--model", str(ckpt), *FAST, *args])

    out = tmp_path / "g.jsonl"
    one_line(run("-o", str(out), "--plot", str(tmp_path / "no" / "f.svg")), "--plot", "mkdir -p")
    one_line(run("-o", str(tmp_path / "no" / "g.jsonl")), "--output", "no folder", "mkdir -p")
    for resume in ([], ["--resume"]):  # a folder is said to be one, not "exists: add --resume"
        msg = one_line(run("-o", str(tmp_path), *resume), "--output", "is a directory")
        assert "--resume" not in msg
    one_line(run("-o", str(out), "--plot", str(tmp_path)), "--plot")
    one_line(run("-o", str(out), "--plot", str(tmp_path), "--dry-run"), "--plot")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_read_only_folder_is_refused_before_measuring(ckpt, tmp_path, nothing_opened, monkeypatch):
    from dgcli.cli import app

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    real = os.access  # root writes anywhere: the folder's answer is made a non-root user's
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(ro) else real(p, mode, **kw))
    r = CliRunner().invoke(app, ["sweep", "--model", str(ckpt), *FAST, "-o", str(ro / "g.jsonl")])
    one_line(r, "--output", "cannot write")


@pytest.mark.parametrize("args, swept, fixed", [
    (["--t-min", "0.9", "--t-max", "1.0,1.2"], "t_max=1.2", "'t_min': 0.9"),
    (["--t-max", "0.3", "--t-min", "0.1,0.2"], "t_min=0.2", "'t_max': 0.3"),
])
def test_single_temperature_beside_a_swept_one_is_checked_per_cell(ckpt, args, swept, fixed):
    r = cli("--model", str(ckpt), *args, "--dry-run")
    assert "plan: 2 cell(s)" in r.stdout and swept in r.stdout and fixed in r.stdout and "skipped" not in r.stdout


def test_the_session_opens_with_a_possible_pair(ckpt, tmp_path, monkeypatch):
    from dgcli.cli import app
    from dgcli.runtime import session

    seen = []

    def opened(model, dummy, layers, preset, flags, **kw):
        seen.append(flags)
        raise UserError("stop here")

    monkeypatch.setattr(session, "open_any", opened)
    r = CliRunner().invoke(app, ["sweep", "--model", str(ckpt), "--t-min", "0.9", "--t-max", "0.5,1.0,1.2",
                                 "-o", str(tmp_path / "g.jsonl")])
    assert str(r.exception) == "stop here" and (seen[0]["t_min"], seen[0]["t_max"]) == (0.9, 1.0)
    r = CliRunner().invoke(app, ["sweep", "--model", str(ckpt), "--t-min", "0.5,0.9", "-o", str(tmp_path / "g.jsonl")])
    assert seen[1]["t_min"] is None  # a base that resolves as given stays as given (agreement's reference)


def test_a_grid_with_no_possible_cell_is_one_error(ckpt, nothing_opened):
    from dgcli.cli import app

    for args in (["--t-min", "0.9", "--t-max", "0.5,0.7"], ["--t-min", "0.85,0.9"]):
        for dry in ([], ["--dry-run"]):
            r = CliRunner().invoke(app, ["sweep", "--model", str(ckpt), *args, *dry])
            one_line(r, "no cell of the grid is possible", "t_max")


@pytest.mark.parametrize("args, words", [
    (["--diffusion-steps", "0,2"], ["--diffusion-steps 0,2", "max_denoising_steps=0"]),
    (["--diffusion-steps", "4,5000"], ["--diffusion-steps", "5000"]),
    (["--t-min", "-1,0.2"], ["--t-min", "t_min=-1"]),
    (["--t-max", "0,0.5"], ["--t-max", "t_max=0"]),
    (["--entropy-bound", "0.1,-0.1"], ["--entropy-bound", "-0.1"]),
    (["--stability-threshold", "1,300"], ["--stability-threshold", "300"]),
    (["--blocks", "-1,2"], ["--blocks", "-1"]),
])
def test_a_value_impossible_on_its_own_is_an_error_not_a_skipped_cell(ckpt, tmp_path, nothing_opened, args, words):
    from dgcli.cli import app

    out = tmp_path / "g.jsonl"
    for dry in ([], ["--dry-run"]):
        one_line(CliRunner().invoke(app, ["sweep", "--model", str(ckpt), *args, "-o", str(out), *dry]), *words)
    assert not out.exists()
    # a value only impossible together with another stays a cell of its own, skipped where it clashes
    assert sw.parse_axes({"t_min": "0.2,0.9", "t_max": "0.5"}) == {"t_min": [0.2, 0.9], "t_max": [0.5]}
