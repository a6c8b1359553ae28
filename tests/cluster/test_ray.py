"""`--ray` on a real Ray cluster on this machine (a head started by `ray start`, real actors, no mocks of
Ray): generate --input-jsonl and sweep write what the local run writes; a worker killed by PID while loading,
between tasks or mid-chunk loses nothing; when every worker dies the written records stay and --resume
finishes (generate and sweep); a bench batch size whose worker died is measured again whole; a sweep
interrupted in the driver resumes without recomputing its finished cells. Plus the cheap checks: Ray is
never imported without --ray, a missing Ray or an unreachable head is one line, exit 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli_run import run
import dgcli

pytest.importorskip("ray")  # the test extra installs it; without it only this file is skipped, and says so

HELDOUT = dgcli.__path__[0] + "/data/prompts/heldout.jsonl"
# Timing figures differ between any two runs; everything else in a record must be equal.
TIMED = re.compile(r"_ms$|_s$|_per_s$|throughput|per_second|duration|peak_memory|provenance|runs_detail|spread|timings")
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _procs_under(marker: str) -> list[int]:
    """PIDs of the processes whose command line names `marker` (the head's own temp folder), and of their
    descendants (Ray's workers rename themselves `ray::...`)."""
    found, parent = set(), {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                # the folder itself, not a longer name it begins (/tmp/rdg12 must not match /tmp/rdg123)
                if re.search(re.escape(marker) + r"(?![0-9])", (p / "cmdline").read_bytes().decode(errors="replace")):
                    found.add(int(p.name))
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    grew = True
    while grew:
        more = {pid for pid, up in parent.items() if up in found} - found
        found |= more
        grew = bool(more)
    return sorted(found)


@pytest.fixture(scope="session")
def head():
    """One Ray head for every cluster test: 2 CPUs, a small object store, in its own temp folder; stopped
    at the end by the PIDs of the processes in that folder (never `ray stop`: it stops every Ray cluster of
    this user on the machine, other test runs' too)."""
    port, temp = _free_port(), f"/tmp/rdg{os.getpid()}"
    ray_cli = str(Path(sys.executable).parent / "ray")
    subprocess.run([ray_cli, "start", "--head", "--num-cpus", "2", "--port", str(port), "--include-dashboard=false",
                    "--object-store-memory", str(200 * 2**20), "--disable-usage-stats", "--temp-dir", temp],
                   env=ENV, check=True, capture_output=True, timeout=120)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for pid in _procs_under(temp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def dgemma(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgcli.cli", *argv], env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def records(text: str) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not TIMED.search(k)} for line in text.splitlines()]


@pytest.fixture(scope="module")
def thirty(tmp_path_factory) -> Path:
    rows = [json.loads(line) for line in open(HELDOUT)][::3][:30]  # every family the bundled model knows
    f = tmp_path_factory.mktemp("ray") / "thirty.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


# ---- cheap: no cluster ----------------------------------------------------------------------------------


def test_ray_is_not_imported_without_the_flag(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Reverse: c a t"}) + "\n")
    code = ("import sys\nfrom dgcli import cli\nimport dgcli.cli.generate, dgcli.cli.sweep, dgcli.cli.bench\n"
            f"sys.argv = ['dgemma', 'generate', '--input-jsonl', {str(f)!r}]\n"
            "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
            "print('ray' in sys.modules, 'dgcli.cluster.driver' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines()[-1] == "False False", out.stderr
    assert out.stdout.splitlines()[0] == "t a c"  # the run itself happened


def test_the_pause_points_are_no_environment_switch():
    """The tests' pause points reach the workers through `Pool.pause`, not the environment: the package reads only
    its four DGEMMA_* settings, so a DGEMMA_RAY_PAUSE left in a shell is named as unknown."""
    out = subprocess.run([sys.executable, "-m", "dgcli.cli", "--version"], env={**ENV, "DGEMMA_RAY_PAUSE": "load:/x"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "dgemma: warning: DGEMMA_RAY_PAUSE is not a dgemma setting" in out.stderr


def test_without_ray_installed_the_flag_is_one_line(thirty, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets in an install without the extra
    code, out, err = run(["generate", "--input-jsonl", str(thirty), "--ray", "local"], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "pip install 'dgemma[ray]'" in err


def test_an_unreachable_head_is_one_line_within_seconds(thirty, capsys):
    t0 = time.monotonic()
    code, out, err = run(["generate", "--input-jsonl", str(thirty), "--ray", f"127.0.0.1:{_free_port()}"], capsys)
    assert time.monotonic() - t0 < 5  # Ray's own connect would retry for minutes
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "no Ray head answers" in err


@pytest.mark.parametrize("argv, words", [
    (["generate", "Reverse: c a t", "--ray", "local"], "--input-jsonl"),
    (["sweep", "--diffusion-steps", "4,8", "--ray-workers", "2", "--dry-run"], "only with --ray"),
    (["bench", "--ray", "local", "--ray-workers", "0"], "must be >= 1"),
    (["bench", "--ray", "local", "--base-url", "http://127.0.0.1:9/v1"], "give one of them"),
    (["generate", "--input-jsonl", HELDOUT, "--ray", "no-port-here"], "HOST:PORT"),
])
def test_bad_ray_flags_are_one_line(argv, words, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1, err


def test_results_come_back_in_input_order():
    from dgcli.cluster.driver import Ordered

    order, seen = Ordered(), []
    for n in (2, 0, 3, 1, 4):
        seen += order.add(n, f"chunk {n}")
    assert seen == [(i, f"chunk {i}") for i in range(5)] and not order.waiting


def test_a_pass_is_joined_from_its_shards():
    from dgcli.cluster.jobs import merge_pass
    from dgcli.measure.metrics import Pass

    a = Pass(["r0", "r1"], 2.0, 4, 10, 15, 1.5, queue_s=[0, 0.1], ttft_s=[1, 2], e2el_s=[3, 4],
             prefix_cache_queries=40, prefix_cache_hits=32)
    b = Pass(["r2"], 3.0, 4, 7, 7, 1.0, queue_s=[0.2], ttft_s=[5], e2el_s=[6], prefix_cache_queries=20,
             prefix_cache_hits=0)
    m = merge_pass([a, b])
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (60, 32)  # a --ray row's hit rate: 32 / 60
    assert m.responses == ["r0", "r1", "r2"] and m.wall_s == 3.0 and m.batch_size == 4
    assert (m.decoder_passes, m.row_steps, m.denoise_s) == (17, 22, 2.5)
    assert m.queue_s == [0, 0.1, 0.2] and m.ttft_s == [1, 2, 5] and m.e2el_s == [3, 4, 6]


# ---- on the cluster ---------------------------------------------------------------------------------------

# Fixed work (every step runs) so a request takes long enough for a kill to land mid-run.
SLOW = ["--confidence-threshold", "0", "--diffusion-steps", "16", "--blocks", "1"]


@pytest.mark.slow
def test_generate_on_the_cluster_writes_what_the_local_run_writes(head, thirty, capsys):
    code, local, _ = run(["generate", "--input-jsonl", str(thirty), "--format", "json", "--batch-size", "2"], capsys)
    assert code == 0
    out = dgemma("generate", "--input-jsonl", str(thirty), "--format", "json", "--batch-size", "2", "--ray", head,
                 "--ray-workers", "2")
    assert out.returncode == 0, out.stderr
    got = records(out.stdout)
    assert [r["index"] for r in got] == list(range(30))
    assert got == records(local)
    assert "30/30 requests done, 2 worker(s) alive" in out.stderr


@pytest.mark.slow
def test_a_worker_killed_mid_run_loses_nothing(head, thirty, capsys):
    code, local, _ = run(["generate", "--input-jsonl", str(thirty), "--format", "json", *SLOW], capsys)
    assert code == 0
    proc = subprocess.Popen([sys.executable, "-m", "dgcli.cli", "generate", "--input-jsonl", str(thirty), "--format",
                             "json", *SLOW, "--ray", head, "--ray-workers", "2"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    err = []
    pids = []
    for line in proc.stderr:  # the workers' PIDs, then the first finished chunk: kill one worker there
        err.append(line)
        if not pids:
            pids = [int(p) for p in re.findall(r"pid (\d+)", line)]
        elif "requests done" in line:
            os.kill(pids[0], signal.SIGKILL)
            break
    out, rest = proc.communicate(timeout=240)
    err = "".join(err) + rest
    assert proc.returncode == 0, err
    assert len(pids) == 2 and f"worker pid {pids[0]} died" in err and "replacement" in err
    assert not re.search(r"30/30 requests done", "".join(err.split("died")[0]))  # the kill landed mid-run
    got = records(out)
    assert [r["index"] for r in got] == list(range(30))  # every record once, in order
    assert got == records(local)


@pytest.mark.slow
def test_sweep_on_the_cluster_and_resume_after_an_interrupted_driver(head, tmp_path):
    grid = ["--diffusion-steps", "4,8", "--entropy-bound", "0.1,0.2", "--num-prompts", "6", "--runs", "1",
            "--no-measure-peaks", "--confidence-threshold", "0"]
    local = dgemma("sweep", *grid, "-o", str(tmp_path / "local.jsonl"), "--format", "json")
    assert local.returncode == 0, local.stderr
    ray_file = tmp_path / "ray.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "dgcli.cli", "sweep", *grid, "-o", str(ray_file), "--format", "json",
                             "--ray", head, "--ray-workers", "2"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            # Ctrl-C must reach it even where this test runs in a shell's background job, which
                            # ignores SIGINT (and a child inherits that)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stderr:
        if line.startswith("dgemma: cell 1/4"):
            proc.send_signal(signal.SIGINT)  # Ctrl-C in the driver, with cells still running
            break
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, rest
    kept = ray_file.read_text().splitlines()
    assert 1 <= len(kept) < 4 and "--resume" in rest
    again = dgemma("sweep", *grid, "-o", str(ray_file), "--resume", "--format", "json", "--ray", head,
                   "--ray-workers", "2")
    assert again.returncode == 0, again.stderr
    assert f"{len(kept)} already in {ray_file}, {4 - len(kept)} to run" in again.stderr
    lines = ray_file.read_text().splitlines()
    assert lines[:len(kept)] == kept  # the finished cells were not run again, nor rewritten
    mine = {r["cell_key"]: r for r in records("\n".join(lines))}
    theirs = {r["cell_key"]: r for r in records((tmp_path / "local.jsonl").read_text())}
    assert len(lines) == 4 and mine == theirs  # each cell once, equal to the local run but for timings


@pytest.mark.slow
def test_a_worker_that_cannot_load_the_model_is_one_line(head, thirty, tmp_path):
    """The driver reads the config (fine here); the workers find no weights."""
    tiny = Path(dgcli.__path__[0]) / "data" / "tiny"
    for f in tiny.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, tmp_path / f.name)
    t0 = time.monotonic()
    out = dgemma("generate", "--input-jsonl", str(thirty), "--model", str(tmp_path), "--ray", head)
    assert time.monotonic() - t0 < 60  # the workers' start (torch imports) is most of it
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [f"dgemma: error: ray worker: {tmp_path}: no model.safetensors or "
                                               "model.safetensors.index.json; is the download complete?"]


@pytest.mark.slow
def test_bench_on_the_cluster_says_who_ran_it(head, capsys):
    argv = ["bench", "--num-prompts", "4", "--runs", "1", "--warmup", "0", "--no-measure-peaks", "--format", "json"]
    code, local, _ = run(argv, capsys)
    assert code == 0
    out = dgemma(*argv, "--ray", head, "--ray-workers", "2")
    assert out.returncode == 0, out.stderr
    row, mine = json.loads(local)["rows"][0], json.loads(out.stdout)["rows"][0]
    assert mine["ray_workers"] == 2 and mine["ray_devices"] == [f"cpu@{socket.gethostname()}"]
    assert out.stderr.count("Ray CPU workers share a node (2 on ") == 1  # their timed shards overlap: said once
    same = ("quality", "num_prompts", "total_output_tokens", "diffusion_denoising_steps", "batched_decoder_passes",
            "steps_histogram", "finish_length_rate")
    assert {k: mine.get(k) for k in same} == {k: row.get(k) for k in same}
    # the threads the workers measured on (the bundled model: the rule's 1), not this driver's count
    assert mine["provenance"]["torch_threads"] == 1 and "1 thread" in mine["provenance"]["threads_source"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_worker_opens_its_session_with_the_drivers_prefix_caching(prefix_caching):
    """--no-prefix-caching reaches each worker's session (the spec it is started with), without a cluster: the
    worker class is plain Python until Ray wraps it."""
    from dgcli.cluster import jobs
    from dgcli.cluster.worker import Worker

    spec = jobs.spec("generate", model=None, preset=None, flags={"device": "cpu"}, compile=False, threads=1,
                     cuda_graphs=None, prefix_caching=prefix_caching)
    assert Worker(spec, cpus=1)._open().prefix_caching is prefix_caching


def test_a_workers_reference_row_is_the_local_one():
    """The sweep's agreement reference computed by a worker (plain Python until Ray wraps it) is the row the
    local sweep computes; the driver saves it through the same `reference_outputs`."""
    from dgcli.cluster import jobs
    from dgcli.cluster.worker import Worker
    from dgcli.measure import sweep as sw
    from dgcli.measure.workload import Prompt
    from dgcli.runtime.session import open_session

    flags = {"device": "cpu", "max_denoising_steps": 2}
    plist = [Prompt([2, 9, 10, 11]), Prompt([2, 12, 13])]
    spec = jobs.spec("any", model=None, preset=None, flags=flags, compile=False, threads=1, cuda_graphs=None)
    theirs = Worker(spec, cpus=1).reference(plist, True, "fp")
    ours = sw.reference_row(open_session(None, None, flags, threads=1), plist, True, "fp", lambda t: None)
    assert theirs == ours and theirs["kind"] == "reference" and len(theirs["outputs"]) == 2
    rows, saved = [], []

    class Store:
        append = staticmethod(saved.append)

    assert sw.reference_outputs(rows, Store(), "agreement", lambda: theirs) == theirs["outputs"]
    assert saved == rows == [theirs]  # saved once; the next call reads it back without making it again
    assert sw.reference_outputs(rows, Store(), "agreement", lambda: 1 / 0) == theirs["outputs"]
    assert sw.reference_outputs(rows, Store(), "exact_match", lambda: 1 / 0) is None


# ---- a worker dying at a known moment --------------------------------------------------------------------
# The workers' pause points (`Pool.pause = "POINT:DIR"`, dgcli/cluster/worker.py) make each kill land where
# the test says: a worker reaching POINT waits, as the file DIR/POINT-PID-N, until the test kills that PID or
# lets it on (DIR/POINT-PID-N.go).


class Referee(threading.Thread):
    """Answers every pause in `folder` in the order they appear: `decide(n, pid)` for the n-th (from 0) says
    whether to SIGKILL that worker there ("kill") or let it on ("go")."""

    def __init__(self, folder: Path, decide):
        super().__init__(daemon=True)
        self.folder, self.decide = folder, decide
        self.seen: list[str] = []
        self.killed: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for mark in sorted(self.folder.iterdir(), key=lambda p: p.stat().st_mtime_ns):
                if mark.suffix == ".go" or mark.name in self.seen:
                    continue
                self.seen.append(mark.name)
                pid = int(mark.name.split("-")[1])
                if self.decide(len(self.seen) - 1, pid) == "kill":
                    os.kill(pid, signal.SIGKILL)
                    self.killed.append(pid)
                else:
                    (self.folder / f"{mark.name}.go").touch()
            time.sleep(0.02)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()


PAUSED = """import sys
from dgcli.cluster.driver import Pool
Pool.pause = sys.argv.pop(1)
from dgcli.cli import main
main()
"""


def paused(point: str, folder: Path) -> list[str]:
    """The start of a `dgemma` command line whose Ray workers pause at `point` (the driver's test-only door)."""
    return [sys.executable, "-c", PAUSED, f"{point}:{folder}"]


@pytest.fixture(scope="module")
def local_b2(thirty, tmp_path_factory) -> list[dict]:
    """The local run every fault test must reproduce: --batch-size 2, JSON records."""
    out = dgemma("generate", "--input-jsonl", str(thirty), "--format", "json", "--batch-size", "2")
    assert out.returncode == 0, out.stderr
    return records(out.stdout)


def ray_generate(thirty: Path, head: str, *extra: str, pause: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(pause or [sys.executable, "-m", "dgcli.cli"]), "generate", "--input-jsonl", str(thirty),
                           "--format", "json", "--batch-size", "2", "--ray", head, "--ray-workers", "2", *extra],
                          env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_worker_killed_while_loading_loses_nothing(head, thirty, local_b2, tmp_path):
    with Referee(tmp_path, lambda n, pid: "kill" if n == 0 else "go") as ref:  # the first worker to load dies
        out = ray_generate(thirty, head, pause=paused("load", tmp_path))
    assert out.returncode == 0, out.stderr
    assert len(ref.killed) == 1 and "died while loading the model" in out.stderr
    assert len(ref.seen) == 3  # the two workers and the dead one's replacement each reached the load
    got = records(out.stdout)
    assert [r["index"] for r in got] == list(range(30)) and got == local_b2


@pytest.mark.slow
def test_a_worker_killed_between_tasks_loses_nothing(head, thirty, local_b2, tmp_path):
    """One worker answers the driver's `describe` (before any chunk) and waits there; the other, loaded and
    idle, is killed meanwhile: the driver finds it dead when it hands it its first chunk."""
    pids: list[int] = []
    listed = threading.Event()

    def decide(n: int, pid: int) -> str:
        assert listed.wait(120)
        other = [p for p in pids if p != pid]
        os.kill(other[0], signal.SIGKILL)
        return "go"

    proc = subprocess.Popen([*paused("describe", tmp_path), "generate", "--input-jsonl", str(thirty), "--format",
                             "json", "--batch-size", "2", "--ray", head, "--ray-workers", "2"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = []
    with Referee(tmp_path, decide):
        try:
            for line in proc.stderr:  # the workers' line comes before the driver asks for `describe`
                err.append(line)
                if "worker(s) on" in line:
                    pids += [int(p) for p in re.findall(r"pid (\d+)", line)]
                    break
            listed.set()
            out, rest = proc.communicate(timeout=240)
        finally:
            proc.kill()  # only if it still runs: a failed check must not leave the driver behind
    err = "".join(err) + rest
    assert proc.returncode == 0, err
    assert len(pids) == 2, err
    idle = [p for p in pids if f"worker pid {p} died with a chunk in flight" in err]
    assert len(idle) == 1 and "replacement" in err
    got = records(out)
    assert [r["index"] for r in got] == list(range(30)) and got == local_b2


@pytest.mark.slow
def test_a_worker_killed_mid_chunk_loses_nothing(head, thirty, local_b2, tmp_path):
    with Referee(tmp_path, lambda n, pid: "kill" if n == 2 else "go") as ref:  # at the start of the third chunk
        out = ray_generate(thirty, head, pause=paused("chunk", tmp_path))
    assert out.returncode == 0, out.stderr
    assert len(ref.killed) == 1 and f"worker pid {ref.killed[0]} died with a chunk in flight" in out.stderr
    assert len(ref.seen) == 9  # 8 chunks, the killed one twice
    got = records(out.stdout)
    assert [r["index"] for r in got] == list(range(30)) and got == local_b2


@pytest.mark.slow
def test_when_every_worker_dies_the_records_stay_and_resume_finishes(head, thirty, local_b2, tmp_path):
    marks, kept = tmp_path / "marks", tmp_path / "out.jsonl"
    marks.mkdir()
    # The first two chunks (rows 0-7) finish; every later chunk kills its worker, replacements included.
    with Referee(marks, lambda n, pid: "go" if n < 2 else "kill") as ref:
        out = ray_generate(thirty, head, "-o", str(kept), pause=paused("chunk", marks))
    assert out.returncode == 2 and out.stdout == ""
    errors = [line for line in out.stderr.splitlines() if line.startswith("dgemma: error:")]
    assert len(errors) == 1 and out.stderr.strip().splitlines()[-1] == errors[0]
    assert "every worker is gone" in errors[0] and "The actor died" in errors[0] and "--resume" in errors[0]
    assert "8 of the 30 record(s)" in errors[0] and len(ref.killed) >= 3
    assert records(kept.read_text()) == local_b2[:8]  # written in order, each whole
    again = ray_generate(thirty, head, "-o", str(kept), "--resume")
    assert again.returncode == 0, again.stderr
    assert "8 of 30 record(s) already in" in again.stderr and "22 to run" in again.stderr
    assert records(kept.read_text()) == local_b2  # every record once, in order


@pytest.mark.slow
def test_sweep_whose_workers_all_die_keeps_its_cells_and_resumes(head, tmp_path):
    grid = ["--diffusion-steps", "4,8", "--entropy-bound", "0.1,0.2", "--num-prompts", "4", "--runs", "1",
            "--no-measure-peaks", "--confidence-threshold", "0", "--format", "json"]
    local = dgemma("sweep", *grid, "-o", str(tmp_path / "local.jsonl"))
    assert local.returncode == 0, local.stderr
    marks, rows = tmp_path / "marks", tmp_path / "ray.jsonl"
    marks.mkdir()
    argv = ["sweep", *grid, "-o", str(rows), "--ray", head, "--ray-workers", "2"]
    with Referee(marks, lambda n, pid: "go" if n == 0 else "kill"):  # one cell finishes, then every worker dies
        out = subprocess.run(paused("chunk", marks) + argv, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("dgemma: error: --ray: every worker is gone") and f"-o {rows} --resume" in last
    assert len(rows.read_text().splitlines()) == 1  # the finished cell, whichever of the first two it was
    again = dgemma(*argv, "--resume", timeout=300)
    assert again.returncode == 0, again.stderr
    mine = {r["cell_key"]: r for r in records(rows.read_text())}
    theirs = {r["cell_key"]: r for r in records((tmp_path / "local.jsonl").read_text())}
    assert len(rows.read_text().splitlines()) == 4 and mine == theirs


@pytest.mark.slow
def test_bench_reruns_a_batch_size_whole_when_a_worker_dies(head, tmp_path, capsys):
    argv = ["bench", "--num-prompts", "4", "--runs", "1", "--warmup", "0", "--no-measure-peaks", "--format", "json"]
    code, local, _ = run(argv, capsys)
    assert code == 0
    with Referee(tmp_path, lambda n, pid: "kill" if n == 0 else "go") as ref:  # one of the two shards dies
        out = subprocess.run([*paused("chunk", tmp_path), *argv, "--ray", head, "--ray-workers", "2"],
                             env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(ref.killed) == 1 and "all its shards run again" in out.stderr
    # the shard beside the dead one finished; then both shards ran again, on the survivor and the replacement
    assert len(ref.seen) == 4 and len({s.split("-")[1] for s in ref.seen[2:]} - {str(ref.killed[0])}) == 2
    row, mine = json.loads(local)["rows"][0], json.loads(out.stdout)["rows"][0]
    same = ("quality", "num_prompts", "total_output_tokens", "diffusion_denoising_steps", "batched_decoder_passes",
            "steps_histogram")
    assert mine["ray_workers"] == 2 and {k: mine.get(k) for k in same} == {k: row.get(k) for k in same}


@pytest.mark.slow
def test_bench_whose_workers_all_die_reports_the_batch_sizes_it_measured(head, tmp_path):
    """Batch size 1 is measured (both shards let on), then every shard of batch size 2 kills its worker, replacements
    included: the row of batch size 1 is still printed, and one line says what was not measured and why."""
    argv = ["bench", "--num-prompts", "4", "--runs", "1", "--warmup", "0", "--no-measure-peaks", "--format", "json",
            "--batch-size", "1,2", "--ray", head, "--ray-workers", "2"]
    with Referee(tmp_path, lambda n, pid: "go" if n < 2 else "kill") as ref:
        out = subprocess.run(paused("chunk", tmp_path) + argv, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and len(ref.killed) >= 3, out.stderr
    assert [r["batch_size"] for r in json.loads(out.stdout)["rows"]] == [1]
    errors = [line for line in out.stderr.splitlines() if line.startswith("dgemma: error:")]
    assert len(errors) == 1 and out.stderr.strip().splitlines()[-1] == errors[0]
    assert "every worker is gone" in errors[0] and "batch size 2 was not measured" in errors[0]
