"""`--ray ADDRESS`: generate --input-jsonl, sweep and bench spread over the actors of a Ray cluster (`driver`: the
pool; `worker`: the actor; `jobs`: each command's chunks). Must not: import Ray unless `--ray` is given.
"""

from __future__ import annotations

from dgcli.errors import UserError


def import_ray():
    """Ray itself, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray, which is not installed: pip install 'dgemma[ray]'") from None
    return ray


def check_flags(ray: str | None, workers: int | None, gpus: float | None) -> None:
    """The --ray-* flags make sense only with --ray, and with sane values (before anything loads)."""
    if ray is None:
        given = [f for f, v in (("--ray-workers", workers), ("--ray-gpus-per-worker", gpus)) if v is not None]
        if given:
            raise UserError(f"{given[0]} applies only with --ray ADDRESS (local, auto or HOST:PORT)")
        return
    if workers is not None and workers < 1:
        raise UserError(f"--ray-workers {workers}: must be >= 1")
    if gpus is not None and gpus < 0:
        raise UserError(f"--ray-gpus-per-worker {gpus}: must be >= 0 (0 on CPU)")
