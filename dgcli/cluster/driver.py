"""The driver side of `--ray`: connecting to a cluster (or starting one on this machine), a pool of worker
actors, and running chunks of work over it with dead workers replaced and their chunks re-run.

Owns: what `--ray local|auto|HOST:PORT` means, the quick reachability check (Ray's own connect retries for
minutes), the actors' resources (`--ray-workers`, `--ray-gpus-per-worker`, CPUs split so workers do not
oversubscribe the cores), the work queue, fault handling (a chunk whose worker died goes back on the queue;
a finished chunk is never run again), the progress line on stderr, and results in input order (`Ordered`).
Must not: know what a chunk computes (dgcli.cluster.jobs does), print to stdout, or load a model here.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

from dgcli.cluster import import_ray
from dgcli.errors import UserError

CONNECT_TIMEOUT_S = 3.0
HEAD_FILE = Path("/tmp/ray/ray_current_cluster")  # where `ray start --head` records its address
OBJECT_STORE_BYTES = 200 * 2**20  # --ray local: results are small; a big store only slows the start
PROGRESS_EVERY_S = 1.0  # off a terminal, the progress line is written at most this often


def _reachable(address: str, flag: str) -> None:
    """One TCP connect with a short timeout: an unreachable head is one line in seconds, not Ray's retries."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"{flag} {address}: give HOST:PORT (e.g. 127.0.0.1:6379), local or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise UserError(f"--ray {address}: no Ray head answers there ({e.strerror or e}); start one with "
                        "`ray start --head --port PORT`, or use --ray local") from None


def _auth_from_token_file() -> None:
    """`ray start --head` writes a token to ~/.ray/auth_token and enforces it; a connecting driver sends it
    only in token mode, so turn that on when a token is at hand (an explicit RAY_AUTH_MODE wins)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or \
            (Path.home() / ".ray" / "auth_token").exists():
        os.environ["RAY_AUTH_MODE"] = "token"


def _errors_to_stderr() -> None:
    """Ray's driver prints the cluster's error messages (e.g. "A worker died...") on stdout, which carries only
    answers here: send them to stderr. Ray 2.60's module function is wrapped (the extra pins that version);
    without it the messages stay where Ray puts them."""
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "dgemma", False):
        return

    def to_stderr(data: dict, ignore_prefix: bool) -> None:
        original({**data, "is_err": True}, ignore_prefix)

    to_stderr.dgemma = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = to_stderr


def connect(address: str) -> tuple[Any, str, bool]:
    """(ray, where, started): `local` starts a cluster on this machine for this run (every core; it advertises
    127.0.0.1, though Ray's servers listen on every interface, behind Ray's default token auth);
    `auto` joins RAY_ADDRESS or the head `ray start` left on this machine; HOST:PORT joins that head."""
    import logging

    if address == "auto":
        found = os.environ.get("RAY_ADDRESS") or (HEAD_FILE.read_text().strip() if HEAD_FILE.exists() else "")
        if not found:
            raise UserError("--ray auto: no Ray head found (RAY_ADDRESS is unset and none was started here); "
                            "start one with `ray start --head`, or use --ray local")
        address = found
    if address != "local":
        _reachable(address.removeprefix("ray://"), "--ray")  # ray://: a Ray Client server, joined as given  # before Ray is even imported: a wrong address is one line, at once
        _auth_from_token_file()  # before Ray is imported too: it reads the mode once
    ray = import_ray()
    _errors_to_stderr()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet = dict(include_dashboard=False, log_to_driver=False, configure_logging=True, logging_level=logging.ERROR)
    if address == "local":
        # address="local": a new cluster even where a head already runs (a bare ray.init() would join that one)
        ray.init(address="local", num_cpus=os.cpu_count() or 1, object_store_memory=OBJECT_STORE_BYTES,
                 _node_ip_address="127.0.0.1", **quiet)
        return ray, f"a local Ray cluster ({os.cpu_count()} CPUs)", True
    quiet.pop("include_dashboard")
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError) as e:
        raise UserError(f"--ray {address}: cannot join the Ray cluster there ({str(e).splitlines()[0]})") from None
    return ray, f"the Ray cluster at {address}", False


class ProgressLine:
    """`dgemma: ray: 12/30 requests done, 2 worker(s) alive` on stderr: rewritten in place on a terminal,
    else a line at most every PROGRESS_EVERY_S seconds (and the last one), so logs stay short."""

    def __init__(self, total: int, unit: str):
        self.total, self.unit = total, unit
        self.stream = sys.stderr
        self.tty = self.stream.isatty()
        self.last = 0.0
        self.shown = ""

    def __call__(self, done: int, alive: int) -> None:
        text = f"dgemma: ray: {done}/{self.total} {self.unit} done, {alive} worker(s) alive"
        now = time.monotonic()
        if text == self.shown or not (self.tty or now - self.last >= PROGRESS_EVERY_S or done == self.total):
            return
        self.shown, self.last = text, now
        self.stream.write(("\r\x1b[2K" + text) if self.tty else text + "\n")
        self.stream.flush()

    def note(self, msg: str) -> None:
        self.stream.write(("\r\x1b[2K" if self.tty and self.shown else "") + msg + "\n")
        self.stream.flush()
        self.shown = ""

    def close(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()


class Pool:
    """`workers` actors of dgcli.cluster.worker.Worker, each opening one session from `spec` (kwargs of the
    session opener), on `gpus` GPUs and an even share of the CPUs each."""

    def __init__(self, address: str, spec: dict, *, workers: int | None, gpus: float | None,
                 warn: Callable[[str], None]):
        import atexit

        self.ray, self.where, self.started = connect(address)
        atexit.register(self.close)  # an error line before the command's own close still stops the workers
        self.spec, self.warn = spec, warn
        self.actors: list[Any] = []
        self.infos: dict[Any, dict] = {}  # actor -> what its load() said (pid, node, device)
        self.replaced = 0
        self.remote_class: Any = None
        try:
            self._resources(workers, gpus)
        except BaseException:
            self.close()
            raise

    def _resources(self, workers: int | None, gpus: float | None) -> None:
        have = self.ray.cluster_resources()
        cpus, gpu_count = int(have.get("CPU", 0)), have.get("GPU", 0)
        self.gpus = (1.0 if gpu_count else 0.0) if gpus is None else float(gpus)
        if workers is None:  # one per GPU, else one per CPU
            workers = int(gpu_count // self.gpus) if self.gpus else cpus
        self.workers = max(1, workers)
        if self.gpus * self.workers > gpu_count:
            raise UserError(f"--ray-workers {self.workers} x --ray-gpus-per-worker {self.gpus:g} needs "
                            f"{self.gpus * self.workers:g} GPU(s); {self.where} has {gpu_count:g}: use fewer workers, "
                            "or --ray-gpus-per-worker 0 on CPU")
        if self.workers > cpus:
            raise UserError(f"--ray-workers {self.workers}: {self.where} has {cpus} CPU(s) and every worker needs one; "
                            f"use --ray-workers {max(1, cpus)} or fewer")
        # CPU workers share the cores evenly (torch threads follow: worker.py caps them); GPU workers need one.
        self.cpus = 1 if self.gpus else max(1, cpus // self.workers)
        self.max_replacements = max(3, 2 * self.workers)  # a chunk that kills every worker must not loop forever

    def _actor(self) -> Any:
        from dgcli.cluster.worker import Worker

        if self.remote_class is None:  # restarts are ours (a replacement, its chunk re-queued), not Ray's
            self.remote_class = self.ray.remote(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0,
                                                max_task_retries=0)(Worker)
        actor = self.remote_class.remote(self.spec, self.cpus)
        self.actors.append(actor)
        return actor

    def start(self) -> list[dict]:
        """Start the workers and load a session in each (in parallel); a worker that cannot load the model is
        one line. Returns what each said: pid, node, device."""
        from ray.exceptions import RayError

        actors = [self._actor() for _ in range(self.workers)]
        try:
            infos = self.ray.get([a.load.remote() for a in actors])
        except RayError as e:
            raise _user_error(e) from None
        self.infos = dict(zip(actors, infos))
        return infos

    def call(self, method: str, *args: Any) -> Any:
        """One call on the first worker (describe, reference outputs), re-tried on a replacement if it dies."""
        for _, value in self.run(method, [args]):
            return value

    def run(self, method: str, chunks: list[tuple], *, sizes: list[int] | None = None,
            progress: ProgressLine | None = None) -> Iterator[tuple[int, Any]]:
        """Every chunk's `method(*chunk)` on some worker; yields (chunk index, result) as each finishes. A worker
        that dies has its chunk put back at the front of the queue and a replacement started."""
        from ray.exceptions import RayActorError, RayError

        ray = self.ray
        queue = deque(range(len(chunks)))
        inflight: dict[Any, tuple[int, Any]] = {}
        idle = list(self.actors)
        done, sizes = 0, sizes or [1] * len(chunks)
        while queue or inflight:
            while queue and idle:
                actor, i = idle.pop(0), queue.popleft()
                inflight[getattr(actor, method).remote(*chunks[i])] = (i, actor)
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
            for ref in ready:
                i, actor = inflight.pop(ref)
                try:
                    value = ray.get(ref)
                except RayActorError as e:
                    queue.appendleft(i)
                    idle.append(self._replace(actor, e, progress))
                    continue
                except RayError as e:
                    raise _user_error(e, bug_ok=False) from None
                idle.append(actor)
                done += sizes[i]
                if progress is not None:
                    progress(done, len(self.actors))
                yield i, value

    def _replace(self, dead: Any, error: Exception, progress: ProgressLine | None) -> Any:
        info = self.infos.pop(dead, {})
        self.actors.remove(dead)
        try:
            self.ray.kill(dead)  # merely unreachable (ActorUnavailableError) must not come back holding its CPUs
        except Exception:
            pass
        self.replaced += 1
        if self.replaced > self.max_replacements:
            raise UserError(f"--ray: {self.replaced} workers died (the last: {_first_line(error)}); giving up. "
                            "The finished results are kept; check the workers' memory and logs")
        actor = self._actor()
        self.infos[actor] = {}
        msg = (f"dgemma: ray: worker pid {info.get('pid', '?')} died ({_first_line(error)}); its unfinished chunk "
               f"goes to a replacement ({self.replaced} so far)")
        (progress.note if progress is not None else self.warn)(msg)
        return actor

    def describe_workers(self) -> str:
        """`2 worker(s) on a local Ray cluster (2 CPUs): pid 123 cpu@127.0.0.1, ...` for stderr and rows."""
        parts = [f"pid {i['pid']} {i['device']}@{i['node']}" for i in self.infos.values() if i]
        return f"{len(self.actors)} worker(s) on {self.where}: " + ", ".join(parts)

    def close(self) -> None:
        """Stop the workers (Ctrl-C stops the cluster work); a cluster started for this run is shut down."""
        ray = self.ray
        if not ray.is_initialized():
            return
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone
                pass
        self.actors = []
        ray.shutdown()


def _first_line(error: Exception) -> str:
    text = str(getattr(error, "cause", None) or error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _user_error(e: Exception, *, bug_ok: bool = True) -> Exception:
    """A worker's own UserError (a model it cannot load, a bad setting) as one line. A worker that cannot start
    (`bug_ok`) is one line too; a failure in a chunk's own code stays the worker's exception, traceback and all."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, UserError):
        return UserError(f"ray worker: {cause}")
    return UserError(f"ray worker failed: {_first_line(e)}") if bug_ok else e


class Ordered:
    """Results in input order from results in any order: a finished chunk waits (in `waiting`) for the
    ones before it. On Ctrl-C the caller may still save what waits."""

    def __init__(self):
        self.next = 0
        self.waiting: dict[int, Any] = {}

    def add(self, index: int, value: Any) -> list[tuple[int, Any]]:
        self.waiting[index] = value
        out = []
        while self.next in self.waiting:
            out.append((self.next, self.waiting.pop(self.next)))
            self.next += 1
        return out
