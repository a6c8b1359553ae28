"""The entropy-bound sampler's rules (spec §7.2) as small pure functions on device tensors, and `sample_step`,
the step the engine's runner makes of them (vocabulary pass, accept, renoise, stop flags).
Must not: loop over steps or blocks, draw random numbers (the step is handed its uniforms and renoise ids), sync
with the host, or know about requests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from dgcli.kernels.dispatch import vocab_pass
from dgcli.kernels.transfer import to_device


@functools.lru_cache(maxsize=8192)
def temperature(n: int, num_steps: int, t_min: float, t_max: float) -> float:
    """T_n = t_min + (t_max - t_min)·n/N for n = N..1 (first step t_max, last t_min + (t_max-t_min)/N;
    never t_min), rounded to float32 the way the reference computes it from an int32 step tensor."""
    ratio = torch.tensor(n, dtype=torch.int32) / num_steps  # float32, as in the reference
    return float(t_min + (t_max - t_min) * ratio)


def accept_mask(entropy: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """Entropy-bound acceptance [B, C] -> bool [B, C]: sort entropies ascending; the position of rank j
    is accepted iff the sum of the strictly lower-ranked entropies (cumsum - self) is <= bound.
    Rank 0 is always accepted. Ties are broken by position (stable sort), lower index first."""
    sorted_h, order = torch.sort(entropy, dim=-1, stable=True)  # [B, C]
    below = torch.cumsum(sorted_h, dim=-1) - sorted_h  # [B, C] the reference's formula, not an exclusive scan
    keep = below <= bound  # [B, C] in sorted order
    return torch.zeros_like(keep).scatter(-1, order, keep)


def is_stable(history: torch.Tensor, argmax: torch.Tensor, depth: torch.Tensor | None = None) -> torch.Tensor:
    """argmax [B, C] equals each of the previous argmaxes in history [S, B, C] -> bool [B]; with `depth`
    [B] (rows with their own stability thresholds <= S), only each row's newest depth[b] entries count.
    History starts filled with -1 (never equal); S = 0 (or depth 0) means always stable (`all` of nothing)."""
    same = (history == argmax[None]).all(dim=-1)  # [S, B]
    if depth is not None:
        s = history.shape[0]
        same = same | (torch.arange(s, device=history.device)[:, None] < s - depth[None, :])  # older: ignored
    return same.all(dim=0)  # [B]


def push_history(history: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """Drop the oldest argmax canvas and append the newest: [S, B, C] -> [S, B, C]."""
    if history.shape[0] == 0:
        return history
    return torch.cat((history[1:], argmax[None]), dim=0)


def is_confident(entropy: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """Mean entropy over the canvas strictly below threshold (a float, or [B] per row): [B, C] -> bool [B]
    (threshold 0: never)."""
    return entropy.mean(dim=-1) < threshold


@dataclass
class RowRules:
    """Per-row accept and stop settings (a batch of requests with different settings) as device tensors; the step
    also takes any object with float entropy_bound and confidence_threshold (one setting for the batch)."""

    entropy_bound: torch.Tensor  # [B, 1] float32
    confidence_threshold: torch.Tensor  # [B] float32
    stability: torch.Tensor  # [B] int64: previous argmaxes that must match (<= the history's depth)

    @classmethod
    def of(cls, params: list[Any], device: torch.device) -> RowRules:
        return cls(to_device([[p.entropy_bound] for p in params], torch.float32, device),
                   to_device([p.confidence_threshold for p in params], torch.float32, device),
                   to_device([p.stability_threshold for p in params], torch.long, device))


# ---- one step from the canvas rows' hidden states -----------------------------------------------------


def sample_step(model: Any, hidden: torch.Tensor, temp: torch.Tensor, history: torch.Tensor, params: Any,
                uniform: torch.Tensor, noise: torch.Tensor, want_soft: bool, compile_tiles: bool = False,
                constrained: Any = None):
    """The sampler's half of a denoising step on hidden states [B, C, H], on the device: vocabulary pass (draws at
    `uniform` [B, C]), accept, renoise (`noise` [B, C] ids where not accepted), stop flags. `constrained(out)`
    redraws the sample and argmax of rows under a schema; entropies, and so acceptance, stay the model's.
    -> (VocabPassOut, accepted, next canvas, history pushed, stop [B])."""
    out = vocab_pass(hidden, model.embed_weight, softcap=model.config.final_logit_softcapping, temperature=temp,
                     embed_scale=model.embed_scale, uniform=uniform, want_soft=want_soft, compile_tiles=compile_tiles)
    if constrained is not None:
        constrained(out)
    accepted = accept_mask(out.entropy, params.entropy_bound)  # [B, C]
    next_canvas = torch.where(accepted, out.sample, noise)  # [B, C]
    stop = is_stable(history, out.argmax, getattr(params, "stability", None)) & \
        is_confident(out.entropy, params.confidence_threshold)  # [B]
    return out, accepted, next_canvas, push_history(history, out.argmax), stop
