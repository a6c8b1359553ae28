"""Kernel launches per layer of one engine pass on the CUDA path, counted on fake CUDA (tests/fake_cuda.py:
`Launches`): the released 26B-A4B config's shapes (a sliding and a full layer), a canvas pass at batch 1 and 8
over a 128-token prefix, the custom ops' real wrappers run with their Triton launches stubbed and counted.
Per layer: the launches of four layers less those of two, halved (the embedding, the final norm and the RoPE
tables are per pass). Eager CUDA pays each launch (~3-5 us of the step at batch 1); a CUDA graph replays them
but still runs one kernel each, so fewer is faster either way.
"""

from __future__ import annotations

import pytest
import torch

from dgcli.checkpoint.config import read_json, real_config_path
from dgcli.model.attention import PassLayout, Segment
from fake_cuda import CUDA, CudaBindings, Launches, fake_cuda, fake_model, real_wrappers  # noqa: F401

S, F = "sliding_attention", "full_attention"
RELEASED = read_json(real_config_path())["text_config"]
CANVAS, PREFIX = 256, 128
BOUND = 24  # launches per layer, bf16, batch 1 and 8 (benchmarks/RESULTS.md: "launches per layer")


def launches(mode, monkeypatch, layers: int, batch: int, weights: str = "bf16") -> list[str]:
    text = {**RELEASED, "num_hidden_layers": layers, "layer_types": [S, F] * (layers // 2)}
    model = fake_model(mode, weights, text, CANVAS)
    counter = Launches()
    with mode, CudaBindings(), torch.inference_mode():  # as the engine runs a pass
        cache = model.new_cache(batch, PREFIX + CANVAS)
        for seq in range(batch):
            cache.reserve(seq, PREFIX + CANVAS)
        layout = PassLayout([Segment(seq, PREFIX, CANVAS, True) for seq in range(batch)], cache, CUDA)
        ids = torch.zeros(batch * CANVAS, dtype=torch.long, device=CUDA)
        soft = torch.empty(batch, CANVAS, RELEASED["hidden_size"], dtype=torch.bfloat16, device=CUDA)
        model.forward_layout(ids, layout, soft)  # the layout's device tables are built once per pass, here
        real_wrappers(monkeypatch, counter)
        with counter:
            model.forward_layout(ids, layout, soft)
    return counter.names


def per_layer(mode, monkeypatch, batch: int, weights: str = "bf16") -> tuple[int, list[str]]:
    two, four = (launches(mode, monkeypatch, n, batch, weights) for n in (2, 4))
    return (len(four) - len(two)) // 2, four


@pytest.mark.parametrize("batch", [1, 8])
def test_launches_per_layer_on_the_released_config(fake_cuda, monkeypatch, batch):
    n, names = per_layer(fake_cuda, monkeypatch, batch)
    print(f"launches per layer: {n} (batch {batch})")
    assert any(name.startswith("triton._paged_attention") for name in names)  # the kernels' launches count
    assert n <= BOUND, "\n".join(names)
