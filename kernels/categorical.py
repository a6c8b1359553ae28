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
# fp32 embedding on CPU: one GEMM call per distinct group, reading its block in place, where the calls (~12 us each,
# taken at this many bytes a call) cost less than the gather's copy: rows sharing a group (a canvas's pad columns;
# nearly every row of the bundled model) read one block (1 thread, W 64, H 160, 16 rows: 71 against 179 us). Not in
# bf16: torch's bf16 bmm on a broadcast block is slower than the gather.
RUN_BYTES = 128 * 2**10


def group_logits(rows: torch.Tensor, embed: torch.Tensor, group: torch.Tensor, width: int,
                 softcap: float | None, temperature: float | torch.Tensor) -> torch.Tensor:
    """Processed logits L [N, width] (fp32; -inf past the vocabulary) of columns group·width + [0, width)
    for rows [N, H]: the head in the embedding dtype, then softcap and temperature as the reference."""
    n, h = rows.shape
    v = embed.shape[0]
    out = torch.empty(n, width, dtype=torch.float32, device=rows.device)
    # Whole groups: each row's group is one contiguous [W, H] block of E, copied as a block (faster than row by row)
    blocks = embed.view(v // width, width, h) if v % width == 0 and embed.is_contiguous() else None
    if blocks is not None and embed.dtype == torch.float32 and group.device.type == "cpu" \
            and _by_group(rows, blocks, group, out):
        return processed_logits(out, softcap, temperature)  # every column < V: its group indexed a block
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


def _by_group(rows: torch.Tensor, blocks: torch.Tensor, group: torch.Tensor, out: torch.Tensor) -> bool:
    """fp32 blocks on CPU (the groups read as a list), when few distinct groups are drawn: each group's [W, H]
    block read in place by its rows (sorted by group), one GEMM call per group, the same call per row as the
    gather's bmm (the same bits: tests/kernels/test_categorical.py), into `out` [N, W]. False (nothing written)
    where the gather costs less: RUN_BYTES per call against its bytes."""
    n, h = rows.shape
    width = blocks.shape[1]
    gl = group.tolist()
    order = sorted(range(n), key=gl.__getitem__)
    starts = [k for k in range(n) if k == 0 or gl[order[k]] != gl[order[k - 1]]]
    if len(starts) * RUN_BYTES >= n * width * h * blocks.element_size():
        return False
    one = len(starts) == 1  # rows already in order
    idx = None if one else torch.tensor(order)
    src = rows if one else rows.index_select(0, idx)
    buf = out if one else torch.empty_like(out)  # the rows' logits in group order
    for lo, hi in zip(starts, [*starts[1:], n]):
        e = blocks[gl[order[lo]]].expand(hi - lo, width, h)  # [k, W, H] one block, not copied
        torch.bmm(src[lo:hi, None, :].to(blocks.dtype), e.transpose(1, 2), out=buf[lo:hi, None, :])
    if idx is not None:
        out.index_copy_(0, idx, buf)
    return True


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
