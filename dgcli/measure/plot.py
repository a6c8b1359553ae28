"""The sweep's speed-quality plot: every cell, the Pareto frontier joined, as a self-contained SVG (or a PNG with
matplotlib); both axes start at 0 and name their figure with its unit. Must not: decide the frontier or measure.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Callable

from dgcli.errors import UserError


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)] if hi > lo else [lo]


def axis_label(key: str) -> str:
    """A figure's name with its unit: "output_throughput [tok/s]" (the definition's bracket); quality is a share."""
    from dgcli.measure.metrics import unit

    if key in ("quality", "exact_match", "agreement"):
        return f"{key} [share, 0-1]"
    return f"{key} [{unit(key)}]" if unit(key) else key


def _svg(pts: list[dict], front: list[dict], x: str, y: str, title: str, label: Callable[[dict], str]) -> str:
    """A self-contained SVG scatter: every cell grey, the frontier red and joined, frontier points labelled."""
    w, h, ml, mr, mt, mb = 720, 480, 80, 200, 40, 60
    xs, ys = [r[x] for r in pts], [r[y] for r in pts]
    # Both axes from 0: a zoomed axis (194.5 to 196.4 tok/s) draws a 1 % difference across the whole plot.
    x0, x1 = min(min(xs), 0.0), max(xs)
    y0, y1 = min(min(ys), 0.0), max(max(ys), 1.0) if max(ys) <= 1 else max(ys)
    x1 += (x1 - x0) * 0.05 or 1.0

    def px(v: float) -> float:
        return ml + (v - x0) / (x1 - x0) * (w - ml - mr)

    def py(v: float) -> float:
        return mt + (1 - (v - y0) / ((y1 - y0) or 1.0)) * (h - mt - mb)

    e = html.escape
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{e(title)}</text>',
           f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
           f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>']
    for t in _ticks(x0, x1):
        out.append(f'<line x1="{px(t):.1f}" y1="{h - mb}" x2="{px(t):.1f}" y2="{h - mb + 5}" stroke="black"/>'
                   f'<text x="{px(t):.1f}" y="{h - mb + 18}" text-anchor="middle">{t:.4g}</text>')
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{ml - 5}" y1="{py(t):.1f}" x2="{ml}" y2="{py(t):.1f}" stroke="black"/>'
                   f'<text x="{ml - 8}" y="{py(t) + 4:.1f}" text-anchor="end">{t:.3g}</text>')
    out.append(f'<text x="{(ml + w - mr) / 2}" y="{h - 15}" text-anchor="middle">{e(axis_label(x))}</text>')
    out.append(f'<text x="18" y="{(mt + h - mb) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 18 {(mt + h - mb) / 2})">{e(axis_label(y))}</text>')
    for r in pts:
        out.append(f'<circle cx="{px(r[x]):.1f}" cy="{py(r[y]):.1f}" r="4" fill="#999"><title>{e(label(r))}</title>'
                   '</circle>')
    if front:
        pts = " ".join(f"{px(r[x]):.1f},{py(r[y]):.1f}" for r in front)
        out.append(f'<polyline points="{pts}" fill="none" stroke="#d62728" stroke-width="2"/>')
        for r in front:
            out.append(f'<circle cx="{px(r[x]):.1f}" cy="{py(r[y]):.1f}" r="5" fill="#d62728"/>'
                       f'<text x="{px(r[x]) + 8:.1f}" y="{py(r[y]) - 6:.1f}" font-size="10">{e(label(r))}</text>')
    out.append(f'<text x="{w - mr + 10}" y="{mt + 10}" fill="#d62728">— Pareto frontier</text>'
               f'<text x="{w - mr + 10}" y="{mt + 28}" fill="#999">● every cell</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def check_plot_path(path: str | Path) -> None:
    """Before any work: the plot's format must be one we can write (its folder: dgcli.cli.sweep checks)."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".svg", ".png"):
        raise UserError(f"--plot {path}: use a .svg or .png file name")
    if suffix == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError(f"--plot {path}: PNG needs matplotlib (pip install matplotlib); or use a .svg name") from None


def write_plot(path: str | Path, rows: list[dict], front: list[dict], x: str, y: str, *, title: str,
               label: Callable[[dict], str]) -> Path:
    """Every cell with both figures, the frontier joined: an SVG, or a PNG through matplotlib."""
    check_plot_path(path)
    p = Path(path)
    pts = [r for r in rows if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float))]
    if not pts:
        raise UserError("nothing to plot: no finished cell has both a speed and a quality figure")
    if p.suffix.lower() == ".svg":
        from dgcli.measure.printers import write_atomic

        write_atomic(p, _svg(pts, front, x, y, title, label))
        return p
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    ax.scatter([r[x] for r in pts], [r[y] for r in pts], c="#999", label="every cell")
    ax.plot([r[x] for r in front], [r[y] for r in front], "o-", c="#d62728", label="Pareto frontier")
    for r in front:
        ax.annotate(label(r), (r[x], r[y]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel(axis_label(x)), ax.set_ylabel(axis_label(y)), ax.set_title(title), ax.legend()
    ax.set_xlim(left=min([0, *(r[x] for r in pts)])), ax.set_ylim(bottom=min([0, *(r[y] for r in pts)]))
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
