"""The whole denoising step with static shapes: run eagerly, through torch.compile, or replayed from CUDA graphs.

Owns: `StaticStep`, a drop-in for `rules.denoise_step` that an engine holds for its KV cache.
One step (decoder pass, vocabulary pass, accept, renoise, stop flags) is one function of device tensors
(`_step`): the rows' positions and cache slots come as tensors, the accept/stop settings as per-row tensors,
and the full layers read a bucketed key span (`key_span`). So for a batch size, span, history depth and
variant (self-conditioning in or not, soft embedding out or not) its shapes never change and it reads
nothing back to the host:
- `compile`: torch.compile of the whole step. In bf16 it is one graph (tests trace it with fullgraph=True);
  fp32 routed experts on CPU read their counts on the host and break it per layer. Measured on CPU it does
  not pay (benchmarks/bench_capture.py): `--compile` keeps the decoder-only compile;
- `graphs` (CUDA): one CUDA graph per (batch size, span, history depth, variant), captured on first use
  after two warm-up runs; a replay copies the inputs into the graph's own buffers and the outputs out.
A static step's numbers equal the dynamic step's up to the attention's summation order (masked keys; see
`model/static.py`): fp32 logits within 4e-5, bf16 within a fifth of bf16's own error; the bundled model's
tokens and step counts equal (tests/sampling/test_static_step.py, tests/model/test_static_decode.py).
Must not: sync with the host, or keep state between steps other than the captured graphs.
"""

from __future__ import annotations

from typing import Any

import torch

from dgcli.kernels.dispatch import vocab_pass
from dgcli.kernels.reference import VocabPassOut
from dgcli.kernels.transfer import to_device
from dgcli.sampling.rules import accept_mask, is_confident, is_stable, push_history

MODES = ("static", "compile", "graphs")  # eager static shapes, torch.compile of the step, CUDA graphs
SPAN_FLOOR = 256  # the smallest full-layer key span: one canvas of the real model


def key_span(need: int, capacity: int, floor: int = SPAN_FLOOR) -> int:
    """Full-layer key slots a static step reads when its longest row holds `need` positions: the smallest power
    of two >= need and >= floor, at most the cache's capacity (a few spans, hence a few captured graphs, cover
    every length; the keys read are under twice those needed)."""
    if need > capacity:
        raise ValueError(f"{need} positions do not fit a cache of {capacity}")
    span = floor
    while span < need:
        span *= 2
    return min(span, capacity)


def _step(model: Any, cache: Any, span: int, want_soft: bool, canvas, soft, temp, history, bound, conf, depth,
          uniform, noise, lens, slots):
    """One step as tensors in, tensors out (what is compiled or captured); `soft` None: no self-conditioning."""
    hidden = model.decode_static(canvas, cache, soft, lens, span, slots)
    out = vocab_pass(hidden, model.embed_weight, softcap=model.config.final_logit_softcapping, temperature=temp,
                     embed_scale=model.embed_scale, uniform=uniform, want_soft=want_soft)
    accepted = accept_mask(out.entropy, bound)
    next_canvas = torch.where(accepted, out.sample, noise)
    stop = is_stable(history, out.argmax, depth) & is_confident(out.entropy, conf)
    return out.sample, out.argmax, out.entropy, out.soft, accepted, next_canvas, push_history(history, out.argmax), stop


class _Graph:
    """One captured step: its input buffers, the graph, its output buffers."""

    def __init__(self, fn, inputs: list[torch.Tensor | None], pool):
        self.inputs = [None if t is None else t.clone() for t in inputs]  # None stays None (a variant's key)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: lazy inits, Triton compiles, allocator
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)

    def __call__(self, inputs: list[torch.Tensor | None]) -> tuple:
        for dst, src in zip(self.inputs, inputs):
            if dst is not None:
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return tuple(None if o is None else o.clone() for o in self.outputs)  # the next replay overwrites them


class StaticStep:
    """`denoise_step` over `cache` with static shapes (`mode` one of MODES)."""

    def __init__(self, model: Any, cache: Any, mode: str):
        if mode not in MODES:
            raise ValueError(f"static step mode {mode!r}: use one of {', '.join(MODES)}")
        dev = model.embed_weight.device
        if mode == "graphs" and dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {dev.type}")
        self.model, self.cache, self.mode, self.device = model, cache, mode, dev
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "graphs" else None
        self.fn = _step
        self.busy, self.key = False, None  # held by an engine; its (slots, capacity, mode) (`acquire`)
        if mode == "compile":
            import torch._dynamo as dynamo

            # a graph per batch size and variant (dynamo's default limit of 8 would send the rest to eager)
            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
            self.fn = torch.compile(_step)

    @classmethod
    def acquire(cls, model: Any, slots: int, max_len: int, mode: str) -> StaticStep:
        """The step for an engine of `slots` rows that needs `max_len` positions, with its own KV cache of a
        bucketed capacity (`key_span`). The step the last engine of that shape left is reused, its captured
        graphs with it (else a one-shot `generate`, or every bench run, would capture again); one engine at a
        time holds a step (`release`). The model keeps only its latest step (and its cache): memory for one
        shape, not one per shape seen."""
        key = (slots, key_span(max_len, 1 << 62), mode)  # capacity: the spans' buckets, unbounded
        step = model.__dict__.get("_static_step")  # a plain attribute, not a submodule
        if step is None or step.busy or step.key != key:
            step = cls(model, model.new_cache(slots, key[1]), mode)
            step.key = key
            model.__dict__["_static_step"] = step
        step.busy = True
        step.cache.lens = [0] * slots
        return step

    def release(self) -> None:
        self.busy = False

    def span(self, lens: list[int]) -> int:
        return key_span(max(lens), self.cache.max_len)

    @torch.inference_mode()
    def __call__(self, canvas: torch.Tensor, soft: torch.Tensor | None, temp: torch.Tensor, history: torch.Tensor,
                 rules: Any, uniform: torch.Tensor, noise: torch.Tensor, want_soft: bool = True,
                 rows: list[int] | None = None) -> tuple[VocabPassOut, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
        """`rules.denoise_step`'s arguments and results, for the canvas rows of cache slots `rows`."""
        b, dev = canvas.shape[0], self.device
        rows = list(range(b)) if rows is None else rows
        lens_host = [self.cache.lens[r] for r in rows]
        lens = to_device(lens_host, torch.long, dev)
        slots = None if rows == list(range(len(self.cache.lens))) else to_device(rows, torch.long, dev)
        bound, conf, depth = self._rules(rules, b, history.shape[0])
        temp = temp.reshape(b) if temp.dim() else temp.expand(b)
        span = self.span(lens_host)
        inputs = [canvas, soft, temp, history, bound, conf, depth, uniform, noise, lens, slots]
        if self.mode == "graphs":  # one graph per shape and variant (self-conditioning in, soft embedding out)
            key = (b, span, history.shape[0], slots is None, soft is None, want_soft)
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = _Graph(
                    lambda *t: _step(self.model, self.cache, span, want_soft, *t), inputs, self.pool)
            got = graph(inputs)
        else:
            got = self.fn(self.model, self.cache, span, want_soft, *inputs)
        sample, argmax, entropy, soft_out, accepted, next_canvas, new_history, stop = got
        return VocabPassOut(sample, argmax, entropy, soft_out), accepted, next_canvas, new_history, stop

    def _rules(self, rules: Any, b: int, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row accept/stop settings as tensors: a `RowRules`' own, or one setting for every row."""
        stability = getattr(rules, "stability", None)
        if stability is not None:
            return rules.entropy_bound, rules.confidence_threshold, stability
        dev = self.device
        return (torch.full((b, 1), float(rules.entropy_bound), dtype=torch.float32, device=dev),
                torch.full((b,), float(rules.confidence_threshold), dtype=torch.float32, device=dev),
                torch.full((b,), depth, dtype=torch.long, device=dev))
