"""`dgemma serve`: an OpenAI-compatible HTTP server over the batched engine (dgcli.serve).

Owns: the serve flags (the sampler flags are the server's defaults), checking them before the model loads,
`--open`, and the exit code of a stop (1 when the engine thread had to be left behind). Must not: contain
server logic (dgcli.serve does).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import Annotated, Callable, Optional

import typer

import dgcli.cli.options as o
from dgcli.cli.console import loading, warn
from dgcli.errors import UserError

EXAMPLES = ["dgemma serve                                   # the bundled model on http://127.0.0.1:8000/v1",
            "dgemma serve --model ~/diffusiongemma-26B-A4B-it --device cuda --max-batch-size 8 --max-model-len 8192",
            "DGEMMA_API_KEY=secret dgemma serve --host 0.0.0.0 --port 8080",
            "dgemma serve --open                            # and open the live web view (http://127.0.0.1:8000/)",
            "curl -s localhost:8000/v1/chat/completions -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Reverse: c a t\"}]}'"]


def serve(
    model: o.Model = None, preset: o.Preset = None, device: o.Device = None, dtype: o.Dtype = None,
    seed: o.Seed = None, steps: o.Steps = None, t_min: o.TMin = None, t_max: o.TMax = None,
    entropy_bound: o.EntropyBound = None, stability_threshold: o.Stability = None,
    confidence_threshold: o.Confidence = None, blocks: o.Blocks = None, max_tokens: o.MaxTokens = None,
    threads: o.Threads = None, compile: o.Compile = False, cuda_graphs: o.CudaGraphs = None,
    low_memory: o.LowMemory = None,
    no_prefix_caching: o.NoPrefixCaching = False, thinking: o.Thinking = False,
    host: Annotated[str, typer.Option("--host", metavar="ADDR", help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", metavar="N", help="TCP port, 0..65535 (0: any free port, printed at start).")] = 8000,
    max_batch_size: Annotated[int, typer.Option("--max-batch-size", metavar="N", help="Requests denoised together (KV-cache slots; continuous batching).")] = 8,
    max_queue: Annotated[int, typer.Option("--max-queue", metavar="M", help="Requests that may wait for a slot; beyond that a request gets 429 at once.")] = 256,
    api_key: Annotated[Optional[str], typer.Option("--api-key", metavar="KEY", help=o.dflt("Require 'Authorization: Bearer KEY'.", "$DGEMMA_API_KEY, else no key"))] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", metavar="NAME", help=o.dflt("The model id clients send.", "the checkpoint directory's name"))] = None,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", metavar="N", help=o.dflt("Positions a request may use (prompt + canvases); the KV cache holds this many per slot, allocated at start.", "the model's context, at most 8192"))] = None,
    shutdown_timeout: Annotated[float, typer.Option("--shutdown-timeout", metavar="S", help="On SIGINT/SIGTERM: seconds in-flight requests get to finish before they are cancelled; the process is gone about a second later whatever the engine is doing (exit 0; 1 if a decoder pass had to be abandoned).")] = 30.0,
    stall_timeout: Annotated[float, typer.Option("--stall-timeout", metavar="S", help="GET /health answers 503 'engine stalled' when the engine has been busy this many seconds without finishing a decoder pass (dgemma_engine_last_progress_seconds in /metrics); 0: never.")] = 60.0,
    open_page: Annotated[bool, typer.Option("--open", help="Open the web page (GET /: watch each block denoise live) in your browser once the server listens; without a display, print its address instead.")] = False,
) -> None:
    """Serve the model over HTTP, OpenAI-compatible (chat, completions, SSE).

    POST /v1/chat/completions and /v1/completions (per-request sampler settings as extra body fields,
    streaming one chunk per committed block, opt-in draft events), GET /v1/models, /health, /metrics, and a
    web page at / that shows each block's canvas denoising live.
    """
    if not 0 <= port <= 65535:  # before the model loads (uvicorn would fail after, with a traceback)
        raise UserError(f"--port {port}: a TCP port is 0..65535 (0: any free port)")
    if api_key is not None and not api_key.strip():  # `--api-key "$UNSET"` would otherwise start an open server
        raise UserError("--api-key is empty: give the key clients must send, or leave --api-key out for a server "
                        "without one")
    from dgcli.runtime.session import fits, open_session
    from dgcli.serve.run import check_limits, context_for, serve as run_server

    check_limits(max_batch_size, max_queue, shutdown_timeout, stall_timeout)

    def check(cfg, resolved, device) -> None:  # every slot's KV cache is allocated at start: refuse what cannot fit
        fits(max_batch_size, "--max-batch-size", context=context_for(cfg, max_model_len),
             context_flag="--max-model-len", idle_slots=True)(cfg, resolved, device)

    flags = o.sampler_flags(steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                            stability=stability_threshold, confidence=confidence_threshold, seed=seed,
                            blocks=blocks, device=device, dtype=dtype, max_tokens=max_tokens)
    key = api_key if api_key is not None else (os.environ.get("DGEMMA_API_KEY") or None)
    with loading("loading the model…"):
        session = open_session(model, preset, flags, compile=compile, threads=threads, cuda_graphs=cuda_graphs,
                               check=check, low_memory=low_memory)
    session.prefix_caching = not no_prefix_caching
    if thinking:
        import dataclasses

        run = dataclasses.replace(session.resolved.run, thinking=True)
        session.resolved = dataclasses.replace(session.resolved, run=run)
    clean = run_server(session, host=host, port=port, slots=max_batch_size, max_queue=max_queue, api_key=key,
                       model_name=served_model_name or session.name, context=context_for(session.config, max_model_len),
                       shutdown_timeout=shutdown_timeout, stall_timeout=stall_timeout,
                       say=_opening(warn) if open_page else warn)
    if not clean:
        # The engine thread is still inside torch: a normal interpreter exit could wait on it or crash under
        # it, so leave now (every request has been answered; the stop line is written).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


STARTED = re.compile(r"^dgemma serve: .* on (http://\S+)/v1 ")  # serve.run's startup line names the address


def has_display() -> bool:
    """Whether a browser window can open here: macOS and Windows always; elsewhere an X11 or Wayland session."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _opening(say: Callable[[str], None]) -> Callable[[str], None]:
    """`say`, which also opens the page when the startup line (the server's real address, --port 0 included)
    goes by: the socket already listens then, so the browser's request waits for uvicorn instead of failing."""

    def say_and_open(line: str) -> None:
        say(line)
        found = STARTED.match(line)
        if not found:
            return
        # A server on every interface is reached here through the loopback.
        url = re.sub(r"//(0\.0\.0\.0|\[::\])", "//127.0.0.1", found.group(1)) + "/"
        if not has_display():
            say(f"dgemma serve: --open: no display here (DISPLAY and WAYLAND_DISPLAY are unset); open {url} in a browser")
            return
        import webbrowser

        # webbrowser may wait on the browser it starts: never hold up the server for it.
        threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()
        say(f"dgemma serve: opening {url} in your browser")

    return say_and_open
