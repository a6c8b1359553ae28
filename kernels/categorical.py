"""The categorical draw of the vocabulary passes that never hold a row's full CDF: `draw_from_groups`, the
reference's rule (the first j with Σ_{i≤j} exp(L_i - M) > u·Σ_i exp(L_i - M), sums in float64) over column groups.

A streaming pass keeps, per row and group of `width` columns, m_g ≥ the group's logits and w_g = Σ exp(L_j - m_g);
this finds the group where the cumulative mass crosses u·total, recomputes that group's logits (`group_logits`) and
finds the column inside it: the reference's draw up to rounding at a CDF boundary. Must not: know about devices
beyond the tensors given, or sync with the host (CPU tensors are read as lists).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .reference import processed_logits

# A row chunk's gathered embedding rows [rows, width, H] stay within this many bytes: under glibc's mmap threshold,
# so a chunk comes from the heap instead of being page-faulted afresh on every call (21 -> 11 ms on the 200 M config).
GATHER_BYTES = 8 * 2**20


def group_logits(rows: torch.Tensor, embed: torch.Tensor, group: torch.Tensor, width: int,
                 softcap: float | None, temperature: float | torch.Tensor) -> torch.Tensor:
    """Processed logits L [N, width] (fp32; -inf past the vocabulary) of columns group·width + [0, width)
    for rows [N, H]: the head in the embedding dtype, then softcap and temperature as the reference."""
    n, h = rows.shape
    v = embed.shape[0]
    out = torch.empty(n, width, dtype=torch.float32, device=rows.device)
    # Whole groups: each row's group is one contiguous [W, H] block of E, copied as a block (faster than row by row)
    blocks = embed.view(v // width, width, h) if v % width == 0 and embed.is_contiguous() else None
    cols = group[:, None] * width + torch.arange(width, device=rows.device)  # [N, W]
    step = max(1, GATHER_BYTES // max(1, width * h * embed.element_size()))
    for lo in range(0, n, step):
        if blocks is not None:
            e = blocks.index_select(0, group[lo:lo + step])  # [r, W, H]
        else:
            e = embed[cols[lo:lo + step].clamp(max=v - 1)]  # [r, W, H]
        # [r, 1, H] x [r, H, W]: each row's W logits as one row by a [W, H] block, a row alone through F.linear's
        # bits here (tests/kernels/test_vocab_pass.py); [r, W, H] x [r, H, 1] is a GEMV torch runs 4-8x slower
        out[lo:lo + step] = torch.bmm(rows[lo:lo + step, None, :].to(embed.dtype), e.transpose(1, 2))[:, 0].float()
    out = processed_logits(out, softcap, temperature)
    return out.masked_fill_(cols >= v, float("-inf"))


def draw_from_groups(gmax: torch.Tensor, gsum: torch.Tensor, u: torch.Tensor, width: int, rows: torch.Tensor,
                     embed: torch.Tensor, softcap: float | None, temperature: float | torch.Tensor,
                     logits_fn: Callable | None = None) -> torch.Tensor:
    """Inverse-CDF draws [N] from per-group statistics gmax, gsum [N, G] (group g = columns g·width ..),
    uniforms u [N] (float64) and the rows/embedding to recompute the chosen group's logits (`logits_fn`,
    default `group_logits`: a device's own kernel may take its place, same arguments and result)."""
    top = gmax.max(dim=1, keepdim=True).values  # [N, 1] the row max M (a group's m_g may exceed its own max)
    mass = gsum.double() * torch.exp((gmax - top).double())  # [N, G] Σ exp(L - M) per group
    cum = mass.cumsum(dim=1)  # [N, G]
    target = u.double() * cum[:, -1]  # [N]
    g = torch.searchsorted(cum, target[:, None], right=True).clamp_(max=cum.shape[1] - 1)  # [N, 1]
    before = torch.where(g > 0, cum.gather(1, (g - 1).clamp_(min=0)), torch.zeros_like(target[:, None]))  # [N, 1]
    g = g[:, 0]
    p = torch.exp((logits_fn or group_logits)(rows, embed, g, width, softcap, temperature) - top).double()  # [N, W]
    inner = p.cumsum(dim=1)  # [N, W]
    j = torch.searchsorted(inner, target[:, None] - before, right=True)[:, 0]  # [N]
    # Rounding (the group's fp32 sum vs this recomputation) can put the target past the group's last
    # column: then the group's last column with mass is the nearest draw.
    last = (torch.arange(width, device=p.device) * (p > 0)).amax(dim=1)  # [N]
    return g * width + torch.minimum(j, last)
