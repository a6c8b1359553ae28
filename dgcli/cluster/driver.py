"""The driver side of `--ray`: connecting to a cluster (or starting one here), a pool of worker actors, and
chunks of work run over it with dead workers replaced and their chunks re-run.

Owns: what `--ray local|auto|HOST:PORT` means, the quick reachability check (Ray's own retries take minutes), the
actors' resources, the work queue, fault handling (`Pool`), the progress line on stderr, results in input order.
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


def _reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--ray {address}: give HOST:PORT (e.g. 127.0.0.1:6379), local or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise UserError(f"--ray {address}: no Ray head answers there ({e.strerror or e}); start one with "
                        "`ray start --head --port PORT`, or use --ray local") from None


def _auth_from_token_file() -> None:
    """`ray start --head` writes a token to ~/.ray/auth_token and enforces it; a connecting driver sends it
    only in token mode, so turn that on when a token is at hand (an explicit RAY_AUTH_MODE wins)."""
    token = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or \
        (Path.home() / ".ray" / "auth_token").exists()
    if token and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"


def _errors_to_stderr() -> None:
    """Ray's driver prints the cluster's errors ("A worker died...") on stdout, which carries only answers here:
    wrap Ray 2.60's printer (the extra pins it) to send them to stderr."""
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
        # Before Ray is imported: a wrong address is one line at once, and Ray reads the auth mode once.
        _reachable(address.removeprefix("ray://"))  # ray://: a Ray Client server, joined as given
        _auth_from_token_file()
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


class WorkersGone(UserError):
    """Every worker died and the restarts are spent (or none could load the model); the caller adds what is kept."""

    def __init__(self, message: str, last: str):
        super().__init__(message)
        self.last = last


def _deaths() -> tuple[type, ...]:
    """Ray's ways of saying a worker's process or node is gone (the work itself did not fail)."""
    import ray.exceptions as x

    names = ("RayActorError", "WorkerCrashedError", "NodeDiedError", "OutOfMemoryError", "ObjectLostError")
    return tuple(getattr(x, n) for n in names if hasattr(x, n))


class Pool:
    """`workers` actors of dgcli.cluster.worker.Worker, each opening one session from `spec`, on `gpus` GPUs and an
    even share of the CPUs each. A worker that dies at any point (loading, idle, mid-chunk) is replaced after a
    backoff, at most `max_replacements` times in all; with none left, `WorkersGone` names the last worker's error."""

    # For tests only: "POINT:DIR" makes each worker wait at POINT (dgcli/cluster/worker.py: `Worker._pause`) so that
    # a test can kill it there. Set it on the class before the command runs; it reaches the workers in their spec.
    pause: str | None = None

    def __init__(self, address: str, spec: dict, *, workers: int | None, gpus: float | None,
                 warn: Callable[[str], None]):
        import atexit

        self.ray, self.where, self.started = connect(address)
        atexit.register(self.close)  # an error line before the command's own close still stops the workers
        self.spec, self.warn = spec, warn
        self.actors: list[Any] = []  # alive: loaded or loading
        self.infos: dict[Any, dict] = {}  # loaded actor -> what its load() said (pid, node, device)
        self.ready: list[Any] = []  # loaded and not running a chunk
        self.loading: dict[Any, Any] = {}  # load() ref -> its actor
        self.due: list[float] = []  # when each scheduled replacement starts (time.monotonic)
        self.replaced = self.deaths = self.loaded = 0
        self.last_error = ""
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

    def _spawn(self) -> None:
        """A new actor, its load() in flight: it joins `ready` when the load returns."""
        from dgcli.cluster.worker import Worker

        if self.remote_class is None:  # restarts are ours (a replacement, its chunk re-queued), not Ray's
            self.remote_class = self.ray.remote(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0,
                                                max_task_retries=0)(Worker)
        actor = self.remote_class.remote(self.spec, self.cpus, self.pause)
        self.actors.append(actor)
        self.loading[actor.load.remote()] = actor

    def start(self) -> list[dict]:
        """Start the workers, loading in parallel; once each first worker has loaded or died (one at least loaded),
        the loaded ones' pid, node and device. A worker that cannot load the model (not a death) is one line."""
        for _ in range(self.workers):
            self._spawn()
        first = set(self.actors)
        while first & (set(self.actors) - set(self.infos)) or not self.infos:
            self._step({})
        return list(self.infos.values())

    def settle(self) -> None:
        """Wait until every live worker has loaded and no replacement is pending (bench's shards run at once)."""
        while self.loading or self.due:
            self._step({})
        if not self.infos:
            raise self._gone()

    def call(self, method: str, *args: Any) -> Any:
        """One call on the first free worker (describe, reference outputs), re-tried elsewhere if it dies."""
        for _, value in self.run(method, [args]):
            return value

    def run(self, method: str, chunks: list[tuple], *, sizes: list[int] | None = None,
            progress: ProgressLine | None = None, whole: bool = False) -> Iterator[tuple[int, Any]]:
        """Every chunk's `method(*chunk)` on some worker; yields (chunk index, result) as each finishes. A dead
        worker's chunk goes back to the front of the queue. `whole` (bench's shards): after a death none starts,
        the running ones finish, and the caller (who sees `deaths` grow) runs them all again."""
        queue = deque(range(len(chunks)))
        inflight: dict[Any, tuple[int, Any]] = {}
        done, sizes, deaths = 0, sizes or [1] * len(chunks), self.deaths
        try:
            while queue or inflight:
                if whole and self.deaths > deaths:
                    queue.clear()
                    if not inflight:
                        break
                while queue and self.ready:
                    actor, i = self.ready.pop(0), queue.popleft()
                    inflight[getattr(actor, method).remote(*chunks[i])] = (i, actor)
                for i, value in self._step(inflight, queue, progress):
                    done += sizes[i]
                    if progress is not None:
                        progress(done, len(self.infos))
                    yield i, value
        finally:
            self.ready.extend(actor for _, actor in inflight.values() if actor in self.infos)

    def _step(self, inflight: dict, queue: deque | None = None,
              progress: ProgressLine | None = None) -> list[tuple[int, Any]]:
        """Wait (at most a second) for a chunk or a load to finish, start the replacements that are due; returns
        the finished chunks. A death re-queues the chunk and schedules a replacement."""
        from ray.exceptions import RayError

        now = time.monotonic()
        while self.due and self.due[0] <= now:
            self.due.pop(0)
            self._spawn()
        refs = list(inflight) + list(self.loading)
        if not refs:
            if not self.due:
                raise self._gone()
            time.sleep(max(0.0, self.due[0] - now))
            return []
        wait = min(1.0, self.due[0] - now) if self.due else 1.0
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=max(0.0, wait))
        out = []
        for ref in ready:
            if ref in self.loading:
                actor = self.loading.pop(ref)
                try:
                    self.infos[actor] = self.ray.get(ref)
                except _deaths() as e:
                    self._died(actor, e, "while loading the model", progress)
                    continue
                except RayError as e:
                    raise _user_error(e) from None
                self.loaded += 1
                self.ready.append(actor)
                continue
            i, actor = inflight.pop(ref)
            try:
                value = self.ray.get(ref)
            except _deaths() as e:
                queue.appendleft(i)
                self._died(actor, e, "with a chunk in flight, which goes back on the queue", progress)
                continue
            except RayError as e:
                raise _user_error(e, bug_ok=False) from None
            self.ready.append(actor)
            out.append((i, value))
        return out

    def _died(self, dead: Any, error: Exception, when: str, progress: ProgressLine | None) -> None:
        """Forget a dead worker; a replacement after a backoff (0.5 s, doubling, at most 8 s) while restarts last."""
        info = self.infos.pop(dead, {})
        self.actors.remove(dead)
        if dead in self.ready:
            self.ready.remove(dead)
        try:
            self.ray.kill(dead)  # merely unreachable (ActorUnavailableError) must not come back holding its CPUs
        except Exception:
            pass
        self.deaths += 1
        self.last_error = _first_line(error)
        who = f"worker pid {info['pid']}" if "pid" in info else "a worker"
        if self.replaced < self.max_replacements:
            self.replaced += 1
            backoff = min(8.0, 0.5 * 2 ** (self.replaced - 1))
            self.due.append(time.monotonic() + backoff)
            then = (f"a replacement starts in {backoff:g} s (restart {self.replaced} of {self.max_replacements}); "
                    f"{len(self.infos)} worker(s) go on meanwhile")
        else:
            then = f"no restarts left; {len(self.actors)} worker(s) go on"
        msg = f"dgemma: ray: {who} died {when} ({self.last_error}); {then}"
        (progress.note if progress is not None else self.warn)(msg)

    def _gone(self) -> WorkersGone:
        if not self.loaded:
            return WorkersGone(f"--ray: no worker could load the model: {self.deaths} died while loading (the last: "
                               f"{self.last_error}); check the workers' memory and logs", self.last_error)
        return WorkersGone(f"--ray: every worker is gone ({self.deaths} died, no restarts left; the last: "
                           f"{self.last_error})", self.last_error)

    def describe_workers(self) -> str:
        """`2 worker(s) on a local Ray cluster (2 CPUs): pid 123 cpu@127.0.0.1, ...` for stderr and rows."""
        parts = [f"pid {i['pid']} {i['device']}@{i['node']}" for i in self.infos.values()]
        loading = len(self.actors) - len(self.infos)
        return f"{len(self.infos)} worker(s) on {self.where}: " + ", ".join(parts) + \
            (f" ({loading} more loading)" if loading else "")

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
        self.actors, self.ready, self.loading, self.due = [], [], {}, []
        ray.shutdown()


def _first_line(error: Exception) -> str:
    text = str(getattr(error, "cause", None) or error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _user_error(e: Exception, *, bug_ok: bool = True) -> Exception:
    """A worker's own UserError as one line, and (`bug_ok`) a worker that cannot start; a failure in a chunk's own
    code stays the worker's exception, traceback and all."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, UserError):
        return UserError(f"ray worker: {cause}")
    return UserError(f"ray worker failed: {_first_line(e)}") if bug_ok else e


class Ordered:
    """Results in input order: a finished chunk waits (in `waiting`: Ctrl-C may still save it) for those before."""

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
