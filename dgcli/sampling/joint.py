"""The joint draw of a constrained row's canvas under its schema's automaton (constrain.py compiles it).

Owns: `constrain` (a step's draw for the rows under a schema) and `processed_logits` (a row's logits as the vocabulary
pass makes them, over any vocabulary rows). Must not: compile schemas, decide which positions are accepted or when a
block stops (rules.py), or touch other rows.

Per constrained row and step: each position's mass of every token chunk (a chunk: up to GROUP tokens of one class),
read one vocabulary tile at a time (never a [C, V] tensor), summed into class masses; a dynamic program over canvas
positions x automaton states on those masses, from the state the committed blocks reached, ending in a state from
which the document can still close in the blocks left (in the last block: closed); forward by log-sum-exp (the sample)
or max (the argmax). Backward, each position takes an edge into the state chosen after it, then a chunk of the edge's
class by its mass, then a token of the chunk by its logit: the flat inverse CDF over (edge, chunk, token) at the row's
own uniform, carried down as the residual uniform inside each chosen interval. So the draw is exact: the model's
per-position distributions restricted to valid canvases; the argmax is the most probable valid canvas. The block's
output is its last argmax, so every committed block is a valid prefix and the last one closes the document.
Memory per row: O(C x (states + chunks)) and a tile of logits [C, TILE].
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

TILE = 16384  # vocabulary columns per tile of the chunk masses: [C, TILE] float32 is 16 MiB at C = 256
_FLOOR = -1e30  # below any logit


def constrain(out: Any, logits: Any, vocab: int, rows: list[tuple[int, Any, int]], uniform: torch.Tensor,
              end_uniform: torch.Tensor) -> None:
    """Replace rows k of `out.sample` and `out.argmax`, for each (k, constraint, block) in `rows`, by the joint draw
    and the most probable valid canvas. `logits(k, ids)`: row k's processed logits over vocabulary rows `ids` (a
    slice: [C, T]; a [C, m] tensor: each position's own, [C, m]); `vocab`: the head's rows; `uniform` [b, C] the
    rows' draws, `end_uniform` [b] one more per row (the state the canvas ends in)."""
    for k, con, block in rows:
        a = con.automaton
        t = a.on(uniform.device, vocab)
        lm, mx = _chunk_masses(lambda ids: logits(k, ids), t["chunk"], t["members"].shape[0], vocab)  # [C, K']
        c, idx = lm.shape[0], t["chunk_cls"].expand_as(lm)  # [C, K']
        cm = torch.full((c, a.k), -math.inf, device=lm.device).scatter_reduce(1, idx, mx, "amax")  # [C, k] class max
        safe = torch.where(torch.isfinite(cm), cm, 0.0)
        mass = safe + torch.zeros_like(cm).scatter_add(1, idx, torch.exp(lm - safe.gather(1, idx))).log()  # [C, k]
        z = torch.logsumexp(mass, 1, keepdim=True)  # [C, 1]: per-position constants leave the joint draw as it is
        room = con.room - block * c  # positions of this canvas and the ones after it that the answer keeps
        ends = t["dist"] <= max(room - c, 0)  # [n+1]: can still close in the canvases left
        for dst_out, w, cw, u, u_end in ((out.sample, mass, lm, uniform[k], end_uniform[k]),
                                         (out.argmax, cm, mx, None, None)):
            kls, r = _path(a.n, t, (w - z).double(), con.state, ends, room, u, u_end)  # [C] each position's class
            j, r = _pick(torch.where(t["chunk_cls"] == kls[:, None], cw, -math.inf), r)  # [C] its chunk
            ids = t["members"][j]  # [C, GROUP]
            x = torch.where(ids >= 0, logits(k, ids.clamp(min=0)), -math.inf)  # [C, GROUP]
            dst_out[k] = ids.gather(1, _pick(x, r)[0][:, None])[:, 0]


def _chunk_masses(logits: Any, chunk: torch.Tensor, n_chunks: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, each chunk's log-sum-exp and max of the logits, [C, K'] each (-inf for none), online over
    vocabulary tiles (a finite floor for "none yet", so that no -inf - -inf turns up)."""
    m = s = None
    for lo in range(0, vocab, TILE):
        x = logits(slice(lo, lo + TILE))  # [C, T]
        idx = chunk[lo:lo + TILE].expand_as(x)  # [C, T]
        new = x.new_full((x.shape[0], n_chunks), _FLOOR).scatter_reduce(1, idx, x, "amax")  # [C, K']
        new = new if m is None else torch.maximum(m, new)
        add = torch.zeros_like(new).scatter_add_(1, idx, torch.exp(x - new.gather(1, idx)))
        s, m = (add if s is None else s.mul_(torch.exp(m - new)).add_(add)), new
    return m + s.log(), torch.where(s > 0, m, -math.inf)


def _only(a: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`a` [n+1] kept where `keep`, unless that leaves nothing (then any live state: the answer is cut by length)."""
    kept = torch.where(keep, a, -math.inf)
    return torch.where(torch.isfinite(kept).any(), kept, a)


def _path(n: int, t: dict, w: torch.Tensor, start: int, ends: torch.Tensor, room: int, u: torch.Tensor | None,
          u_end: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One canvas's classes [C] on the automaton, closed by position `room` when that is inside it, from class weights
    `w` [C, k]: drawn at uniforms `u` [C] and `u_end` (with each position's residual uniform [C]), or (u None) the
    max path."""
    src, kls, dst = t["src"], t["kls"], t["dst"]
    c = w.shape[0]
    alpha = [w.new_full((n + 1,), -math.inf)]
    alpha[0][start] = 0.0
    for i in range(c):  # forward: alpha[i+1][s'] = reduce over edges s -k-> s' of alpha[i][s] + w[i][k]
        a = _reduce(alpha[i][src] + w[i][kls], dst, n + 1, u is None)
        alpha.append(_only(a, torch.arange(n + 1, device=a.device) == n) if i + 1 == room else a)  # closed
    s = _pick(_only(alpha[c], ends), u_end)[0]
    got, res = [], []
    for i in reversed(range(c)):  # backward: the edge into s at position i
        j, r = _pick(torch.where(dst == s, alpha[i][src] + w[i][kls], -math.inf), None if u is None else u[i])
        got.append(kls[j])
        res.append(r)
        s = src[j]
    return torch.stack(got[::-1]), None if u is None else torch.stack(res[::-1])


def _reduce(w: torch.Tensor, dst: torch.Tensor, size: int, use_max: bool) -> torch.Tensor:
    """Per destination state: the max of `w` or its log-sum-exp."""
    m = w.new_full((size,), -math.inf).scatter_reduce(0, dst, w, "amax")
    if use_max:
        return m
    safe = torch.where(torch.isfinite(m), m, 0.0)
    total = w.new_zeros(size).scatter_add(0, dst, torch.exp(w - safe[dst]))
    return safe + torch.log(total)


def _pick(w: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Along the last dim of `w` [..., N]: the argmax (u None), or an inverse-CDF draw from softmax(w) at uniform u
    [...] (float64, as the vocab pass) and the residual uniform: where u fell inside the chosen entry's interval."""
    if u is None:
        return torch.argmax(w, -1), None
    cdf = torch.cumsum(torch.exp((w - w.amax(-1, keepdim=True)).double()), -1)  # [..., N]
    x = u.double()[..., None] * cdf[..., -1:]  # [..., 1]
    j = torch.minimum(torch.searchsorted(cdf, x, right=True), (cdf < cdf[..., -1:]).sum(-1, keepdim=True))
    lo = torch.where(j > 0, cdf.gather(-1, (j - 1).clamp(min=0)), 0.0)
    r = ((x - lo) / (cdf.gather(-1, j) - lo)).clamp(0.0, 1.0 - 2**-53)  # [..., 1]
    return j[..., 0], r[..., 0]


def processed_logits(model: Any, hidden: torch.Tensor, temp: torch.Tensor, ids: slice | torch.Tensor) -> torch.Tensor:
    """A row's processed logits from its canvas hidden states [C, H], as the vocabulary pass makes them, over the
    vocabulary rows `ids`: a slice ([C, T]) or each position's own [C, m] (-> [C, m])."""
    e = model.embed_weight
    raw = (F.linear(hidden, e[ids]) if isinstance(ids, slice) else torch.einsum("ch,cmh->cm", hidden, e[ids])).float()
    cap = model.config.final_logit_softcapping
    return (torch.tanh(raw / cap) * cap if cap else raw) / temp
