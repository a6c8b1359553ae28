"""Test-wide setup (import path, one intra-op thread, the Triton interpreter without a GPU) and the
fixtures several test folders share. Tests marked `slow` are deselected by default (pyproject.toml's
addopts); `-m 'slow or not slow'` runs them too (the README's test command)."""

import os
import sys
from pathlib import Path

# tests/ helpers (hf_oracle, fixtures) import as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The console script lives beside this interpreter (e.g. .venv/bin): subprocesses and tmux shells
# must find `dgemma` there even when the venv is not activated (CI runs .venv/bin/python -m pytest).
os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")

# Tests use tiny shapes on 2 shared cores: a second intra-op thread only adds barrier waits
# (oversubscribed, tiny ops run up to 50x slower). OMP_NUM_THREADS reaches the subprocesses (and the
# tmux shells) the tests start too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

# Without a GPU the Triton kernels run in the interpreter; the variable must be set before any kernel
# module is imported, and test modules import each other's dependencies in any order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def cli_ckpt(tmp_path_factory):
    """One random checkpoint (with tokenizer) shared by the CLI-level tests that only read it."""
    from hf_oracle import CLI_CANVAS, CLI_TEXT

    from dgcli.model.random_weights import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("cli") / "ckpt", CLI_TEXT, canvas_length=CLI_CANVAS)


@pytest.fixture(scope="session")
def bundled_heldout():
    """The bundled model's answers to every held-out prompt, each run alone as eval_bundled runs them: fp32,
    block cap 4, seed 0, the rest from the checkpoint, one thread. The quality floor
    (tests/train/test_bundled_model.py) and the batch-invariance test (tests/sampling/test_batch.py) both
    read them, so the ~100 solo runs happen once per session. Returns (session, encoded prompts,
    responses), both lists in the file's order."""
    import dgcli
    from dgcli.cli.options import sampler_flags
    from dgcli.runtime import request
    from dgcli.runtime.session import open_session
    from dgcli.text.prompts import read_prompt_file

    session = open_session(None, None, sampler_flags(blocks=4, seed=0, device="cpu", dtype="float32"))
    prompts = [request.encode(session, row["prompt"])
               for row in read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the recorded numbers (benchmarks/RESULTS.md) were measured on one thread
    try:
        with torch.no_grad():
            responses = [request.run(session, ids) for ids in prompts]
    finally:
        torch.set_num_threads(threads)
    return session, prompts, responses
