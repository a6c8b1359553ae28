"""The engines' reads of device values on the host, declared in one place.

Owns: `read(t, why)`, the only way the engine and the server's worker bring device values to the host while they
run, for one of `READS`: "stop" (a pass's stop flags), "commit" (the tokens of the blocks that ended), "draft"
(`dgemma serve`'s drafts for a client that asked) and "prompt" (a device prompt's ids, once, when it is given).
`substituted(fn)` hands `fn`'s values out instead for the reads made inside it: a fake-tensor run has no values,
and there every other host read is an error.
Must not: read anything else, or decide anything with what it reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

READS = ("stop", "commit", "draft", "prompt")

_substitute: Callable[[torch.Tensor, str], list] | None = None


def read(t: torch.Tensor, why: str) -> list:
    """t's values as a (nested) Python list: the declared host read `why` (one of READS)."""
    if why not in READS:
        raise ValueError(f"undeclared host read {why!r}: declare it in READS")
    if _substitute is not None:
        return _substitute(t, why)
    return t.tolist()


@contextlib.contextmanager
def substituted(fn: Callable[[torch.Tensor, str], list]) -> Iterator[None]:
    """Inside: `read(t, why)` returns fn(t, why) and never touches t's values."""
    global _substitute
    saved, _substitute = _substitute, fn
    try:
        yield
    finally:
        _substitute = saved
