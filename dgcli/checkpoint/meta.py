"""The DiffusionGemma module tree on the meta device: what every checkpoint format builds first and then fills
(assigned from files, drawn at random, or converted), so no second full copy of the weights is ever made.

Owns: `meta_model`. Must not: read files or hold values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from dgcli.model.config import ModelConfig
from dgcli.model.gemma import DiffusionGemma

# torch.nn.init functions the modules' constructors call; skipped on the meta device (see `meta_model`).
_INIT_FNS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "ones_", "zeros_",
             "constant_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    saved = {n: getattr(nn.init, n) for n in _INIT_FNS}
    try:
        for n in _INIT_FNS:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def meta_model(cfg: ModelConfig) -> DiffusionGemma:
    """The module tree on the meta device, parameter init skipped: init ops on meta tensors go through
    torch._refs, which imports torch._dynamo (~1 s of start-up), and every value is assigned later anyway."""
    with torch.device("meta"), _no_init():
        return DiffusionGemma(cfg)
