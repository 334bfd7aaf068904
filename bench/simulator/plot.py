"""A tiny SVG writer for line charts (no plotting library in the environment), and the
rollout/trainer split chart of ``recommend``. bench/rl_curve.py draws with it too."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .model import MODES

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    color: str
    dashed: bool = False
    mark: Optional[int] = None  # index of a point to ring (e.g. the best split)


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 × a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / target
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    start = math.floor(lo / step) * step
    return [round(start + i * step, 10) for i in range(int(math.ceil((hi - start) / step)) + 1)]


def _fmt(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e4 else f"{v:.0e}"


def svg_chart(panels: list[Panel], title: str, width: int = 560, height: int = 420) -> str:
    """Line charts side by side, each with axes, ticks, grid and a legend."""
    from xml.sax.saxutils import escape

    left, right, top, bottom = 70, 20, 60, 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(panels)}" height="{height}" '
           f'font-family="Helvetica, Arial, sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width * len(panels) / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">'
           f'{escape(title)}</text>']
    for k, panel in enumerate(panels):
        x0, x1, y0, y1 = k * width + left, (k + 1) * width - right, height - bottom, top
        xs = [x for s in panel.series for x in s.xs]
        ys = [y for s in panel.series for y in s.ys] + [0.0]
        xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(0.0, max(ys) * 1.05)
        sx = lambda v: x0 + (v - xt[0]) / (xt[-1] - xt[0]) * (x1 - x0)  # noqa: E731
        sy = lambda v: y0 - (v - yt[0]) / (yt[-1] - yt[0]) * (y0 - y1)  # noqa: E731
        out.append(f'<text x="{(x0 + x1) / 2}" y="{top - 14}" text-anchor="middle" font-size="13">{escape(panel.title)}</text>')
        for v in xt:
            out.append(f'<line x1="{sx(v):.1f}" y1="{y0}" x2="{sx(v):.1f}" y2="{y1}" stroke="#e5e5e5"/>'
                       f'<text x="{sx(v):.1f}" y="{y0 + 16}" text-anchor="middle">{_fmt(v)}</text>')
        for v in yt:
            out.append(f'<line x1="{x0}" y1="{sy(v):.1f}" x2="{x1}" y2="{sy(v):.1f}" stroke="#e5e5e5"/>'
                       f'<text x="{x0 - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
        out.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#444"/>')
        out.append(f'<text x="{(x0 + x1) / 2}" y="{height - 18}" text-anchor="middle">{escape(panel.xlabel)}</text>')
        out.append(f'<text transform="translate({k * width + 18},{(y0 + y1) / 2}) rotate(-90)" text-anchor="middle">'
                   f'{escape(panel.ylabel)}</text>')
        for j, s in enumerate(panel.series):
            points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(s.xs, s.ys))
            dash = ' stroke-dasharray="6,4"' if s.dashed else ""
            out.append(f'<polyline points="{points}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>')
            if len(s.xs) > 2:  # a measured curve, not a reference line
                out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{s.color}"/>' for x, y in zip(s.xs, s.ys)]
            if s.mark is not None:
                out.append(f'<circle cx="{sx(s.xs[s.mark]):.1f}" cy="{sy(s.ys[s.mark]):.1f}" r="6" fill="none" '
                           f'stroke="{s.color}" stroke-width="2"/>')
            ly = y1 + 14 + 16 * j
            out.append(f'<line x1="{x1 - 150}" y1="{ly - 4}" x2="{x1 - 128}" y2="{ly - 4}" stroke="{s.color}" '
                       f'stroke-width="2"{dash}/><text x="{x1 - 122}" y="{ly}">{escape(s.label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def split_plot(params: float, report: list[dict], focus_gpus: int) -> str:
    """Left: the best mode's throughput per GPU against the rollout share, one line per
    cluster size, its optimum ringed. Right: every mode at one cluster size."""
    best_mode = "async+skew"
    left = []
    for k, row in enumerate(report):
        curve = row["curves"][best_mode]
        if not curve:
            continue
        xs = [r / row["gpus"] for r, _ in curve]
        ys = [res.samples_per_s / row["gpus"] for _, res in curve]
        left.append(Series(f"{row['gpus']} GPUs", xs, ys, PALETTE[k % len(PALETTE)], mark=ys.index(max(ys))))
    focus = next(r for r in report if r["gpus"] == focus_gpus)
    right = []
    for mode in MODES:
        curve = focus["curves"][mode]
        if curve:
            base, _, skew = mode.partition("+")
            ys = [res.samples_per_s for _, res in curve]
            right.append(Series(mode, [r / focus_gpus for r, _ in curve], ys, PALETTE[("sync", "stream", "async").index(base)],
                                dashed=bool(skew), mark=ys.index(max(ys))))
    if focus["colocated_sync"] is not None and right:
        flat = focus["colocated_sync"].samples_per_s
        right.append(Series("sync colocated", [right[0].xs[0], right[0].xs[-1]], [flat, flat], "#000000", dashed=True))
    return svg_chart([Panel(f"{best_mode}, by cluster size", "share of GPUs generating", "samples/s per GPU", left),
                      Panel(f"every mode, {focus_gpus} GPUs", "share of GPUs generating", "samples/s", right)],
                     f"Rollout/trainer split for a {params / 1e9:g}B model (simulated)", width=560)
