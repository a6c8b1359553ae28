"""`--cuda-graphs` (generate, bench, sweep, serve): decode-only passes replay CUDA graphs (model/graphs.py;
tests/sampling/test_graphs.py checks their events). Where graphs cannot run the flag is one `dgemma: error:`
line before any weights load (and, for serve, before the port is bound): without a CUDA device, with --compile,
without Triton. The error tests hide the GPU where there is one (so they run on every machine)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cli_run import forbid, run
from dgcli.errors import UserError
from dgcli.runtime import request
from dgcli.runtime import session as sess

TINY_BENCH = ["--random-prompts", "--num-prompts", "1", "--random-input-len", "4", "--runs", "1", "--warmup", "0",
              "--no-measure-peaks", "--diffusion-steps", "2"]


@pytest.fixture
def no_cuda(monkeypatch):
    """This process sees no CUDA device (a no-op on a machine without one), as `--device auto` asks torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Loading weights (a checkpoint or random ones) or binding a port fails the test."""
    from dgcli.checkpoint import load as loader, random_weights
    from dgcli.serve import run as serve_run

    forbid(monkeypatch, ((loader, "load_model"), (random_weights, "random_model"), (serve_run, "serve")),
           "weights were loaded (or the server started) before --cuda-graphs was checked")


def one_error_line(code, out, err):
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "--cuda-graphs" in lines[0] and "CUDA" in lines[0] and "Traceback" not in err, err
    assert lines[0].startswith("dgemma: error: ") and "--device cuda" in lines[0], err


@pytest.mark.parametrize("argv", [
    ["generate", "--cuda-graphs", "hi"],
    ["bench", "--cuda-graphs", *TINY_BENCH],
    ["bench", "--cuda-graphs", "--dummy", "26B-A4B", "--layers", "1", *TINY_BENCH],
    ["sweep", "--cuda-graphs", "--diffusion-steps", "2,4", "--num-prompts", "1", "--runs", "1", "--warmup", "0",
     "--no-measure-peaks"],
    ["serve", "--cuda-graphs", "--port", "1"],
], ids=["generate", "bench", "bench-dummy", "sweep", "serve"])
def test_cuda_graphs_without_cuda_is_one_line_before_loading(capsys, no_cuda, nothing_loaded, tmp_path, monkeypatch,
                                                            argv):
    monkeypatch.chdir(tmp_path)  # sweep's default --output
    one_error_line(*run(argv, capsys))


def test_serve_with_cuda_graphs_exits_before_binding(tmp_path):
    """As a real process: the error line, exit 2, and nothing listening (the GPU hidden where there is one)."""
    import os
    import subprocess
    import sys

    from server_proc import free_port

    port = free_port()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "dgcli.cli", "serve", "--cuda-graphs", "--port", str(port)],
                       capture_output=True, text=True, timeout=120, env=env)
    one_error_line(p.returncode, p.stdout, p.stderr)


def test_the_check_and_the_step_mode():
    assert sess.check_cuda_graphs(False, torch.device("cpu")) == "dynamic"
    assert sess.check_cuda_graphs(True, torch.device("cuda", 0)) == "graphs"  # no GPU needed: only the type
    with pytest.raises(UserError, match=r"--cuda-graphs needs a CUDA device \(this run is on cpu\)"):
        sess.check_cuda_graphs(True, torch.device("cpu"))
    with pytest.raises(UserError, match="--compile does not apply to it: drop one of them"):
        sess.check_cuda_graphs(True, torch.device("cuda", 0), compile=True)
    assert sess.check_cuda_graphs(False, torch.device("cpu"), compile=True) == "dynamic"
    # the CLI's default (no flag): graphs where they run, else the dynamic step, never an error
    assert sess.check_cuda_graphs(None, torch.device("cuda", 0)) == "graphs"
    assert sess.check_cuda_graphs(None, torch.device("cuda", 0), compile=True) == "dynamic"
    assert sess.check_cuda_graphs(None, torch.device("cpu")) == "dynamic"
    assert sess.check_cuda_graphs(False, torch.device("cuda", 0)) == "dynamic"  # --no-cuda-graphs


def test_a_library_session_takes_the_clis_default():
    """`dgcli.open_session()` without cuda_graphs: the CLI's default (graphs where they run: CUDA with Triton),
    so the README's "denoise-only passes replay CUDA graphs" holds for library callers too."""
    import inspect

    import dgcli

    assert inspect.signature(sess.open_session).parameters["cuda_graphs"].default is None
    assert dgcli.open_session(settings={"device": "cpu"}).step_mode == "dynamic"  # off CUDA: the dynamic step
    assert sess.open_session(None, None, {"device": "cpu"}, cuda_graphs=False).step_mode == "dynamic"


def test_a_graphs_session_off_cuda_is_one_clear_error():
    """A graphs session reaching an engine without the paged Triton kernel (a library caller past the CLI's
    check) gets one line, not a silent dynamic run."""
    s = sess.open_session(None, None, {"device": "cpu", "max_denoising_steps": 4})
    graphs = dataclasses.replace(s, step_mode="graphs")
    ids = request.encode(s, "Reverse: c a t")
    with pytest.raises(UserError, match="drop --cuda-graphs"):
        request.run(graphs, ids)


def test_bench_provenance_says_the_step_mode(capsys):
    code, out, err = run(["bench", *TINY_BENCH, "--format", "json"], capsys)
    assert code == 0, err
    prov = json.loads(out)["rows"][0]["provenance"]
    # graphs by default where bench ran on CUDA, the dynamic step elsewhere
    assert prov["step_mode"] == ("graphs" if prov["device"] == "cuda" else "dynamic")
    assert prov["compiled_decoder"] is False
    # the paged attention's backend: the Triton kernel where bench ran on CUDA (its default there), else SDPA
    assert prov["kernels"]["attention"] == ("triton-paged" if prov["device"] == "cuda" else "torch-sdpa")


def test_cuda_graphs_is_refused_with_base_url(capsys):
    code, out, err = run(["bench", "--base-url", "http://127.0.0.1:9", "--cuda-graphs"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "--cuda-graphs does not apply with --base-url" in err


@pytest.mark.parametrize("cmd", ["generate", "bench", "sweep", "serve"])
def test_every_model_command_lists_the_flag(capsys, cmd):
    code, out, _ = run([cmd, "--help"], capsys)
    assert code == 0 and "--cuda-graphs" in out and "--no-cuda-graphs" in out
