"""Running the server: the worker thread, the app, uvicorn, and a clean stop.

Owns: `serve(session, ...)`: the engine's context (a KV cache for `slots` requests of `context` positions, allocated
once), the listening socket, and the shutdown. SIGINT/SIGTERM: stop admitting (503) and listening, let in-flight
requests finish for up to `shutdown_timeout` s, withdraw what is left (answered by the HTTP side, so a long pass
cannot hold them), stop the engine thread: True (exit 0); an engine thread still in a pass ENGINE_GRACE s later is
left behind: False (exit 1). A second Ctrl-C stops at once (uvicorn's force exit; app.py answers 503 quietly).
Must not: parse requests or touch the engine directly.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import uvicorn

from dgcli.errors import UserError
from dgcli.serve.app import State, build_app
from dgcli.serve.images import vision_context
from dgcli.serve.metrics import Metrics
from dgcli.serve.protocol import Context
from dgcli.serve.worker import Worker


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: State, shutdown_timeout: float):
        super().__init__(config)
        self.dgemma = state
        # At the timeout the worker withdraws what is left: each stream ends with an error object and
        # [DONE], each waiting request gets 503, so uvicorn's own wait ends without cancelling a task.
        self.deadline = threading.Timer(shutdown_timeout, state.worker.abort)
        self.deadline.daemon = True
        self.shutdown_timeout = shutdown_timeout
        self.stop_by: float | None = None  # monotonic time by which the engine thread must be done

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.dgemma.closing:
            self.dgemma.closing = True
            self.stop_by = time.monotonic() + self.shutdown_timeout
            self.deadline.start()
        super().handle_exit(sig, frame)
        # uvicorn re-raises a caught signal after its shutdown, which would turn a clean stop into a death by signal
        getattr(self, "_captured_signals", []).clear()


DEFAULT_CONTEXT = 8192
ENGINE_GRACE = 1.0  # s the engine thread gets to end its pass after the requests are withdrawn


def context_for(cfg: Any, max_model_len: int | None) -> int:
    """The positions a request may use (prompt + its canvases): --max-model-len, at most the model's; by default
    the model's context up to 8192 (the cache is allocated up front per slot: 262144 positions take tens of GB)."""
    limit = cfg.max_position_embeddings
    if max_model_len is None:
        return min(limit, DEFAULT_CONTEXT)
    if max_model_len < 2 * cfg.canvas_length:
        raise UserError(f"--max-model-len {max_model_len}: needs room for a prompt and a canvas of "
                        f"{cfg.canvas_length}; use at least {2 * cfg.canvas_length}")
    if max_model_len > limit:
        raise UserError(f"--max-model-len {max_model_len} is beyond the model's context of {limit}; use at most {limit}")
    return max_model_len


def check_limits(slots: int, max_queue: int, shutdown_timeout: float, stall_timeout: float) -> None:
    """The serving limits, checked by `build` and by `dgemma serve` before the model loads."""
    if slots < 1:
        raise UserError(f"--max-batch-size {slots}: must be >= 1")
    if max_queue < 0:
        raise UserError(f"--max-queue {max_queue}: must be >= 0 (0 = no waiting: 429 when every slot is busy)")
    for flag, value in (("--shutdown-timeout", shutdown_timeout), ("--stall-timeout", stall_timeout)):
        if not value >= 0:  # NaN too
            raise UserError(f"{flag} {value}: must be >= 0 seconds")


def build(session: Any, *, host: str, port: int, slots: int, max_queue: int, api_key: str | None,
          model_name: str, context: int, shutdown_timeout: float,
          stall_timeout: float = 60.0) -> tuple[_Server, Worker]:
    """The uvicorn server (not started) and the engine's worker (not started) for `session`."""
    check_limits(slots, max_queue, shutdown_timeout, stall_timeout)
    if session.tokenizer is None:
        raise UserError(f"{session.path}: no tokenizer.json; dgemma serve needs the checkpoint's tokenizer")
    metrics = Metrics(slots)
    # A slot holds a request's prompt and all but its last canvas (the last block is never encoded).
    try:
        worker = Worker(session, slots=slots, max_len=context - session.config.canvas_length, metrics=metrics)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "alloc" not in str(e).lower():
            raise
        raise UserError(f"the KV cache for {slots} slot(s) of {context} positions does not fit in memory on "
                        f"{session.device}; lower --max-model-len or --max-batch-size") from None
    ctx = Context(session.tokenizer, model_name, session.params, session.resolved.run.max_tokens,
                  session.config.canvas_length, context, thinking=session.resolved.run.thinking,
                  stop_ids=tuple(session.stop_ids), **vision_context(session))
    state = State(worker, ctx, max_queue=max_queue, api_key=api_key, stall_timeout=stall_timeout)
    # A backstop: at the timeout every handler is answered, so only a client that stops reading is cut here.
    config = uvicorn.Config(build_app(state), host=host, port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=shutdown_timeout + ENGINE_GRACE, access_log=False)
    return _Server(config, state, shutdown_timeout), worker


def loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower().rstrip(".") == "localhost" or host.lower().endswith(".localhost")


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a port in use is one clear line (uvicorn would log and exit 3)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port or --host") from None
    return sock


def serve(session: Any, *, say: Callable[[str], None], **kw: Any) -> bool:
    """Serve until SIGINT/SIGTERM (keywords as `build`'s); True after a clean stop, False when the engine thread
    was left behind in a pass (exit at once)."""
    server, worker = build(session, **kw)
    sock = listen(kw["host"], kw["port"])
    worker.start()
    state, slots, context = server.dgemma, kw["slots"], kw["context"]
    mib = worker.engine.cache.nbytes() / 2**20
    host, port = kw["host"], sock.getsockname()[1]  # --port 0: the one the system picked
    where = f"[{host}]" if ":" in host else host
    say(f"dgemma serve: {kw['model_name']} on http://{where}:{port}/v1 ({session.resolved.run.device}, "
        f"{session.resolved.run.dtype}; {slots} slot(s) of {context} positions, KV cache {mib:,.1f} MiB; "
        f"queue up to {kw['max_queue']}{'; API key required' if kw['api_key'] else ''})")
    if not kw["api_key"] and not loopback(host):  # served all the same, as vLLM does
        say(f"dgemma serve: note: listening on {host} without --api-key: anyone who can reach the port can use it")
    try:
        server.run(sockets=[sock])
    finally:
        state.closing = True
        server.deadline.cancel()
        state.pool.shutdown(wait=False, cancel_futures=True)
        wait = ENGINE_GRACE if server.force_exit or server.stop_by is None else server.stop_by - time.monotonic()
        stopped = worker.close(timeout=max(ENGINE_GRACE, wait))
        sock.close()
    if not stopped:
        say(f"dgemma serve: stopped; the engine was still in a decoder pass at the end of the shutdown timeout "
            f"({kw['shutdown_timeout']:g} s) and was left behind (exit code 1)")
        return False
    say("dgemma serve: stopped")
    return True
