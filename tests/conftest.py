"""Test-wide setup (import path, one intra-op thread, the Triton interpreter only without a GPU, the
devices present) and the fixtures several test folders share. Tests marked `slow` are deselected by
default (pyproject.toml's addopts); `-m 'slow or not slow'` runs them too (the README's test command)."""

import os
import sys
from pathlib import Path

# tests/ helpers (hf_oracle, fixtures) import as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The console script lives beside this interpreter (e.g. .venv/bin): subprocesses and tmux shells
# must find `dgemma` there even when the venv is not activated (CI runs .venv/bin/pytest).
os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")

# Tests use tiny shapes on 2 shared cores: a second intra-op thread only adds barrier waits
# (oversubscribed, tiny ops run up to 50x slower). OMP_NUM_THREADS reaches the subprocesses (and the
# tmux shells) the tests start too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)



def triton_interpreter_needed(cuda_available: bool) -> bool:
    """The suite's one decision on how Triton kernels run: compiled where CUDA exists, in the interpreter
    (TRITON_INTERPRET=1, kernels on CPU tensors) where it does not. Tests call it with the answer injected."""
    return not cuda_available


def apply_triton_mode(env: dict, cuda_available: bool) -> None:
    """Set or clear TRITON_INTERPRET in `env` by `triton_interpreter_needed`. On a GPU an inherited
    TRITON_INTERPRET=1 is dropped: it would quietly turn the compiled-kernel tests into interpreter runs
    (and DOT_BF16 off), which is what a GPU run of this suite exists to avoid."""
    if triton_interpreter_needed(cuda_available):
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)


# Decided here, once, before any test module (and so any kernel module, which reads the variable when
# Triton is imported and its kernels defined) is imported; CLI subprocesses inherit the result.
CUDA = torch.cuda.is_available()
apply_triton_mode(os.environ, CUDA)
# Devices the model and CLI tests run on (`device` fixture): the CPU always, the GPU where there is one.
DEVICES = ("cpu", "cuda") if CUDA else ("cpu",)
# Devices the Triton kernels run on (`triton_device` fixture): compiled on the GPU where there is one,
# else the interpreter on CPU tensors (a CPU tensor cannot reach a compiled kernel).
TRITON_DEVICES = ("cuda",) if CUDA else ("cpu",)


import pytest  # noqa: E402


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device present: "cpu", and "cuda" on a machine with a GPU."""
    return request.param


@pytest.fixture(params=TRITON_DEVICES)
def triton_device(request) -> str:
    """Where the Triton kernels run in this session: "cuda" (compiled) or "cpu" (interpreted)."""
    return request.param


@pytest.fixture(scope="session")
def cli_ckpt(tmp_path_factory):
    """One random checkpoint (with tokenizer) shared by the CLI-level tests that only read it."""
    from hf_oracle import CLI_CANVAS, CLI_TEXT

    from dgcli.checkpoint.random_weights import write_random_checkpoint

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


@pytest.fixture(scope="session")
def vision_ckpt(tmp_path_factory):
    """A tiny checkpoint with a vision tower (hf_oracle.write_vision_checkpoint), shared by the image tests."""
    from hf_oracle import write_vision_checkpoint

    return write_vision_checkpoint(tmp_path_factory.mktemp("vision") / "ckpt")


@pytest.fixture(scope="session")
def tokenizer_262k(tmp_path_factory):
    """A ChatTokenizer of the real vocabulary's size, 262,144 tokens (tests/vocab262k.py)."""
    from vocab262k import write_tokenizer_262k

    from dgcli.text.tokenizer import load_tokenizer

    return load_tokenizer(write_tokenizer_262k(tmp_path_factory.mktemp("vocab262k")))
