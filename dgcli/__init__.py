"""dgemma: run, watch, sweep and benchmark DiffusionGemma block text-diffusion checkpoints.

Owns: `__version__` and the public shortcuts (`load_model`, `open_session`, `generate`). Must not: import
torch or any subpackage at import time (every `dgemma` run, `--help` included, imports this first).
"""

__version__ = "0.1.0"


def load_model(path, device="cpu", dtype=None):
    """Load a DiffusionGemma checkpoint directory (see `dgcli.model.loader.load_model`)."""
    from dgcli.model.loader import load_model as _load

    return _load(path, device=device, dtype=dtype)


def open_session(model=None, preset=None, settings=None, **kw):
    """A checkpoint (default: the bundled model) loaded with its tokenizer and resolved settings; `settings`
    maps preset keys to values (see `dgcli.runtime.session.open_session`)."""
    from dgcli.runtime.session import open_session as _open

    return _open(model, preset, dict(settings or {}), **kw)


def generate(session, prompt, **kw):
    """One prompt to a `Response` (text, token_ids, finish_reason, ...; see `dgcli.runtime.request.generate`)."""
    from dgcli.runtime.request import generate as _generate

    return _generate(session, prompt, **kw)
