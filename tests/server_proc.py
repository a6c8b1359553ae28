"""`dgemma serve` as a real subprocess on a free port, for the server and remote-bench tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: str):
        self.proc, self.port, self.log_path = proc, port, log
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig`, wait for the exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"dgemma serve did not exit within {timeout} s of signal {sig}:\n{self.log()}")


@contextmanager
def serve(*args: str, tmp_path, env: dict | None = None, ready_s: float = 120.0):
    """Start `dgemma serve --port P *args`, wait until /health answers, yield a `Server`; stop it (SIGTERM)
    at the end."""
    port = free_port()
    log = str(tmp_path / f"serve-{port}.log")
    cmd = [sys.executable, "-m", "dgcli.cli", "serve", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(proc, port, log)
    deadline = time.monotonic() + ready_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"dgemma serve exited with {proc.returncode} before it was ready:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise AssertionError(f"dgemma serve not ready after {ready_s} s:\n{server.log()}")
        time.sleep(0.2)
    try:
        yield server
    finally:
        if proc.poll() is None:
            server.stop()


@contextmanager
def in_process(session, *, slots: int, prepare=None):
    """The real app, worker and uvicorn over `session` in this process (a thread), for tests that reach into
    the server's state; `prepare(state)` runs before it starts. Yields (base URL, state)."""
    import threading

    from dgcli.serve.run import build

    port = free_port()
    server, worker = build(session, host="127.0.0.1", port=port, slots=slots, max_queue=8, api_key=None,
                           model_name="tiny", context=session.config.max_position_embeddings, shutdown_timeout=5)
    if prepare is not None:
        prepare(server.dgemma)
    worker.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield url, server.dgemma
    finally:
        server.should_exit = True
        thread.join(20)
        worker.close(10)


class Scripted:
    """The real model, except that a pass returns hidden states whose logits peak at `script[prefix_len]` for
    each canvas (its segment's start): a decoder that writes chosen text, for `in_process` servers."""

    def __init__(self, real, script, sharp=30.0):
        self.real, self.script, self.sharp = real, script, sharp

    def __getattr__(self, name):
        return getattr(self.real, name)

    def forward_pass(self, ids, segments, cache, soft=None):
        import torch

        self.real.forward_pass(ids, segments, cache, soft)  # the cache as the real pass leaves it
        starts = [s.start for s in segments if s.canvas]
        if not starts:
            return None
        w = self.real.embed_weight
        target = w[torch.stack([self.script[p] for p in starts])]  # [B, C, H]
        return (self.sharp * target / (target * target).sum(-1, keepdim=True)).to(w.dtype)
