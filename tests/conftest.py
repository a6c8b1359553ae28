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
