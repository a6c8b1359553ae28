"""CUDA graphs of the engine's decode-only passes: one graph per batch bucket, replayed with the pass's data.

Owns: `PassGraphs`. A pass whose rows are all canvases replays the graph of the smallest bucket (1, 2, 4, ... up
to the engine's slots) holding them; padding rows are canvases of a dummy sequence the engine reserves (positions
0..C-1, reading only its own keys), their results dropped. A replay first copies the pass's data into the bucket's
static inputs (ids, the self-conditioning input, zeros for none, and `PassLayout.load`: block tables at a fixed
width over every sequence). Graphs are captured lazily after two eager runs (Triton compiles, caches filled), in
one shared memory pool. Without CUDA (`capture=False`, tests) the same static path runs eagerly. Bits: a replay is
the eager static path; padding rows join the GEMMs, which on CUDA may pick other algorithms (within bf16 bounds).
Must not: schedule, sample or read device values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dgcli.errors import UserError
from dgcli.model.attention import PassLayout, Segment, backend


def buckets(slots: int) -> list[int]:
    """1, 2, 4, ... below `slots`, then `slots`."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


@dataclass
class _Static:
    ids: torch.Tensor  # [B*C] int64
    soft: torch.Tensor  # [B, C, H]
    layout: PassLayout
    out: torch.Tensor | None = None  # [B, C, H] the captured pass's result
    graph: Any = None  # torch.cuda.CUDAGraph, None when not captured (no CUDA)


class PassGraphs:
    def __init__(self, model: Any, cache: Any, dummy_seq: int, slots: int, *, capture: bool):
        self.model, self.cache, self.dummy, self.capture = model, cache, dummy_seq, capture
        self.c, self.hidden = model.config.canvas_length, model.config.hidden_size
        self.device = model.embed_weight.device
        if backend(self.device) != "triton-paged":
            raise UserError(f"--cuda-graphs needs the paged Triton attention kernel (CUDA with Triton; this engine is on "
                            f"{self.device.type}): drop --cuda-graphs")
        self.sizes = buckets(slots)
        self.static: dict[int, _Static] = {}
        self.pool = None
        self.replays = 0

    def forward(self, ids: torch.Tensor, segments: list, soft: torch.Tensor | None) -> torch.Tensor | None:
        """The pass's canvas hidden states [b, C, H] by a replay, or None when the pass is not decode-only (the
        caller runs it eagerly). The result is the graph's output buffer: read it before the next replay."""
        b = len(segments)
        if not segments or any(not s.canvas for s in segments) or b > self.sizes[-1]:
            return None
        size = next(n for n in self.sizes if n >= b)
        pad = [Segment(self.dummy, 0, self.c, True)] * (size - b)
        layout = PassLayout([Segment(s.seq, s.start, s.length, True) for s in segments] + pad, self.cache,
                            self.device, every_seq=True)
        st = self.static.get(size)
        if st is None:
            st = self.static[size] = _Static(
                torch.zeros(size * self.c, dtype=torch.long, device=self.device),
                torch.zeros(size, self.c, self.hidden, dtype=self.model.embed_weight.dtype, device=self.device), layout)
        else:
            st.layout.load(layout)
        st.ids[:b * self.c].copy_(ids)
        st.ids[b * self.c:].zero_()
        if soft is None:
            st.soft.zero_()
        else:
            st.soft[:b].copy_(soft)
            st.soft[b:].zero_()
        if st.graph is None and self.capture:
            self._capture(st)
        if st.graph is not None:
            st.graph.replay()
            self.replays += 1
        else:
            st.out = self.model.forward_layout(st.ids, st.layout, st.soft)
        return st.out[:b]

    def _capture(self, st: _Static) -> None:
        """Two eager runs on a side stream (compiles, autotuning and the model's caches happen there), then the
        capture. The eager runs write the pass's own keys, as the replay will: the cache ends the same."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.forward_layout(st.ids, st.layout, st.soft)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            st.out = self.model.forward_layout(st.ids, st.layout, st.soft)
        self.pool = graph.pool()
        st.graph = graph
