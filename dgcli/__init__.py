"""dgemma: run, watch, sweep and benchmark DiffusionGemma block text-diffusion checkpoints.

Owns: `__version__` and the public shortcuts (`load_model`, `open_session`; `generate`, `stream`, `run_batch` and
`LLMEngine` by name, loaded at first use). Must not: import torch or any subpackage at import time (every `dgemma`
run, `--help` included, imports this first).
"""

__version__ = "0.1.0"


def load_model(path, device="cpu", dtype=None):
    """Load a DiffusionGemma checkpoint directory or GGUF file. `device`: "cpu", "cuda", "cuda:N", "auto" (CUDA if
    present) or a torch.device, checked before any file is read; `dtype`: "bfloat16", "float32", a torch.dtype, or
    None for the checkpoint's."""
    import re
    from os import PathLike

    import torch

    from dgcli.errors import UserError
    from dgcli.checkpoint.load import load_model as _load
    from dgcli.runtime.session import pick_device

    name = str(device) if isinstance(device, torch.device) else device
    if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise UserError(f"device={device!r}: use \"cpu\", \"cuda\", \"cuda:N\" or \"auto\" (CUDA if present)")
    device = pick_device(name, flag="device=")  # now: the loader would blame the file or torch's pinned memory
    if not isinstance(path, (str, PathLike)):
        raise UserError(f"path={path!r}: give a checkpoint directory or GGUF file (a str or Path)")
    if dtype is not None and not isinstance(dtype, (str, torch.dtype)):
        raise UserError(f"dtype={dtype!r}: give \"bfloat16\", \"float32\", a torch.dtype, or None for the checkpoint's")
    return _load(path, device=device, dtype=dtype)


def open_session(model=None, preset=None, settings=None, **kw):
    """A checkpoint (default: the bundled model) loaded with its tokenizer and resolved settings; `settings`
    maps preset keys to values (see `dgcli.runtime.session.open_session`)."""
    from collections.abc import Mapping
    from os import PathLike

    from dgcli.errors import UserError

    if model is not None and not isinstance(model, (str, PathLike)):
        raise UserError(f"model={model!r}: give a checkpoint directory or GGUF file (a str or Path), or leave it "
                        "out for the bundled model")
    if preset is not None and not isinstance(preset, (str, PathLike)):
        raise UserError(f"preset={preset!r}: give a preset name (e.g. \"fast\") or a .yaml path, or leave it out")
    if settings is not None and not isinstance(settings, Mapping):
        raise UserError(f"settings={settings!r}: give a dict of preset keys, e.g. settings={{\"seed\": 1}}")
    from dgcli.runtime.session import open_session as _open

    return _open(None if model is None else str(model), None if preset is None else str(preset),
                 dict(settings or {}), **kw)


_LAZY = {"generate": "dgcli.runtime.request", "stream": "dgcli.runtime.request", "run_batch": "dgcli.runtime.request",
         "LLMEngine": "dgcli.engine"}


def __getattr__(name):
    """`generate` (one prompt to a `Response`), `stream`, `run_batch` and `LLMEngine`, imported at first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'dgcli' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
