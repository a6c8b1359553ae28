"""Host values onto the device without waiting for it (for the model, the engines and the server's worker).

Why: on CUDA a copy from pageable memory first waits for the stream to drain (a host sync with the pass in
flight); a pinned buffer copied with non_blocking does not (the caching host allocator keeps it alive until the
copy is done). tests/fake_cuda.py's `PageableCopies` finds any other copy. Must not: read device values back.
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
