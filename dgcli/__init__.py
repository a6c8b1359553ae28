"""dgemma: run, watch, sweep and benchmark DiffusionGemma block text-diffusion checkpoints.

Owns: `__version__` and the `load_model` shortcut. Must not: import torch or any subpackage at import
time (every `dgemma` run, `--help` included, imports this first).
"""

__version__ = "0.1.0"


def load_model(path, device="cpu", dtype=None):
    """Load a DiffusionGemma checkpoint directory (see `dgcli.model.loader.load_model`)."""
    from dgcli.model.loader import load_model as _load

    return _load(path, device=device, dtype=dtype)
