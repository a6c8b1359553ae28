"""`--ray ADDRESS`: generate --input-jsonl, sweep and bench spread over the actors of a Ray cluster.

`driver` connects (or starts a local cluster) and runs chunks of work over a pool of actors, replacing
dead ones; `worker` is the actor, one session each, calling the same library functions a local run calls;
`jobs` turns each command's work into chunks and their results back into what the local run writes.
Must not: be imported unless `--ray` is given (Ray is an optional extra), or contain a denoising loop.
"""

from __future__ import annotations

from dgcli.errors import UserError

INSTALL = "pip install 'dgemma[ray]'"


def import_ray():
    """Ray itself, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(f"--ray needs Ray, which is not installed: {INSTALL}") from None
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
