"""Host values onto the device without waiting for it (for the model, the engines and the server's worker).

Owns: `to_device`. On CUDA a plain `torch.tensor(values, device=cuda)` (or `cpu_tensor.to(cuda)`) copies
from pageable memory and first waits for the stream to drain: a host sync with whatever pass is in flight.
A pinned buffer copied with non_blocking does not wait (the caching host allocator keeps the buffer alive
until the copy is done). The model, the engines and the server's worker send their small per-pass data
(row lengths, seeds, steps, temperatures, prompt ids) this way; tests/fake_cuda.py's `PageableCopies`
finds any other. Must not: read device values back.
"""

from __future__ import annotations

import torch


def to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list (or CPU tensor) as a `dtype` tensor on `device`; on CUDA through a pinned buffer."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype, device=device)
    host = torch.as_tensor(values, dtype=dtype)
    # Pinned by allocating, not by torch.tensor(pin_memory=True): the same pinned copy, and it also runs on
    # fake CUDA tensors in a CPU-only torch (tests/fake_cuda.py), which cannot pin from data.
    return torch.empty(host.shape, dtype=dtype, pin_memory=True).copy_(host).to(device, non_blocking=True)
