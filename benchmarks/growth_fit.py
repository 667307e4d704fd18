"""Fits, tables and a figure for benchmarks/cost_growth.py: how a step's time and peak memory grow along one axis.

Per side (meshrl, TRL), axis (group size, completion length, model size) and metric (median step time in s, peak
PSS in GB), two least-squares fits over the points that ran (``status == "ok"``), in float64:

    linear     y = a + b x
    quadratic  y = a + b x + c x^2

The quadratic fit is *preferred* when it removes more than half of the linear fit's residual sum of squares and
there are at least 4 points (a third coefficient on 3 points always fits exactly); otherwise the linear one. At each
measured x the shares of the terms, |a|, |b x| and |c x^2| over their sum, say which one dominates there. The
memory fit, solved for ``max_gb``, gives the x at which a side would reach that much memory (the smallest x >= 0
where the preferred fit reaches it; None when it never does). Nothing here runs a model: pure Python and torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from xml.sax.saxutils import escape

import torch

TERMS = ("constant", "linear", "quadratic")
SHORT = {"constant": "const", "linear": "lin", "quadratic": "quad"}
METRICS = {"time_s": "s / step", "peak_gb": "peak GB (PSS)"}
SIDE_COLOURS = {"meshrl": "#1f77b4", "trl": "#d62728"}
PREFER_QUADRATIC_RSS_RATIO = 0.5


@dataclass
class Measured:
    """One grid point of one side as the fit sees it: x on its axis, the label shown for it, what happened."""

    x: float
    label: str
    status: str  # ok | oom | timeout | error
    time_s: float | None = None
    peak_gb: float | None = None
    response_len: float | None = None

    def value(self, metric: str) -> float | None:
        return getattr(self, metric) if self.status == "ok" else None


@dataclass
class Fit:
    """``y = coef[0] + coef[1] x (+ coef[2] x^2)`` with its residual sum of squares over ``n`` points."""

    coef: list[float]
    rss: float
    n: int

    @property
    def kind(self) -> str:
        return "linear" if len(self.coef) == 2 else "quadratic"

    def terms(self, x: float) -> list[float]:
        return [c * x**k for k, c in enumerate(self.coef)]

    def __call__(self, x: float) -> float:
        return sum(self.terms(x))

    def shares(self, x: float) -> list[float]:
        """|term| / sum of |terms| at ``x``, one per coefficient (constant, linear[, quadratic])."""
        mags = [abs(t) for t in self.terms(x)]
        total = sum(mags)
        return [m / total if total > 0 else 0.0 for m in mags]

    def dominant(self, x: float) -> str:
        shares = self.shares(x)
        return TERMS[max(range(len(shares)), key=shares.__getitem__)]

    def reach(self, y: float) -> float | None:
        """Smallest x >= 0 with fit(x) = y, approached from below (0 when fit(0) >= y already); None if never."""
        a, b = self.coef[0] - y, self.coef[1]
        c = self.coef[2] if len(self.coef) > 2 else 0.0
        if a >= 0:
            return 0.0
        if c == 0.0:
            return -a / b if b > 0 else None
        disc = b * b - 4 * c * a
        if disc < 0:
            return None
        roots = sorted(r for r in ((-b - math.sqrt(disc)) / (2 * c), (-b + math.sqrt(disc)) / (2 * c)) if r >= 0)
        return roots[0] if roots else None

    def text(self, digits: int = 3) -> str:
        parts = [f"{self.coef[0]:.{digits}g}", f"{self.coef[1]:+.{digits}g} x"]
        if len(self.coef) > 2:
            parts.append(f"{self.coef[2]:+.{digits}g} x²")
        return " ".join(parts)


def fit_poly(xs: list[float], ys: list[float], degree: int) -> Fit:
    """Least squares of ``ys`` on ``1, x, .., x^degree`` (float64); needs more than ``degree`` distinct xs."""
    if len(set(xs)) <= degree:
        raise ValueError(f"a degree-{degree} fit needs at least {degree + 1} distinct x values, got {sorted(set(xs))}")
    x = torch.tensor(xs, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    design = torch.stack([x**k for k in range(degree + 1)], dim=1)
    # Columns scaled to unit max first: x^2 up to ~1e6 next to a column of ones conditions the solve badly.
    scale = design.abs().amax(dim=0).clamp_min(1e-300)
    sol = torch.linalg.lstsq(design / scale, y.unsqueeze(1), driver="gelsd").solution.squeeze(1) / scale
    resid = y - design @ sol
    return Fit([float(v) for v in sol], float(resid @ resid), len(xs))


def preferred(linear: Fit, quadratic: Fit | None) -> Fit:
    """The quadratic fit when it removes more than half of the linear fit's residual (and had >= 4 points)."""
    if quadratic is None or quadratic.n < 4:
        return linear
    if linear.rss <= 1e-12 * max(1.0, abs(linear.coef[0])) ** 2:
        return linear  # the points lie on a line: nothing left for a quadratic term to explain
    return quadratic if quadratic.rss < PREFER_QUADRATIC_RSS_RATIO * linear.rss else linear


@dataclass
class MetricFits:
    """Both fits of one (axis, side, metric) and what they say at the measured xs."""

    linear: Fit
    quadratic: Fit | None
    best: Fit
    xs: list[float]
    reach_x: float | None = None  # memory only: where ``best`` reaches the limit

    def as_dict(self) -> dict:
        quad = self.quadratic
        return {
            "linear": self.linear.coef, "linear_rss": self.linear.rss,
            "quadratic": quad.coef if quad else None, "quadratic_rss": quad.rss if quad else None,
            "preferred": self.best.kind,
            "quadratic_share": {f"{x:g}": quad.shares(x)[2] for x in self.xs} if quad else None,
            "dominant": {f"{x:g}": self.best.dominant(x) for x in self.xs},
            "reach_x": self.reach_x,
        }


def fit_metric(points: list[Measured], metric: str, max_gb: float | None) -> MetricFits | None:
    """Fits of ``metric`` over the points that ran; None with fewer than 2 distinct xs."""
    pairs = [(p.x, v) for p in points if (v := p.value(metric)) is not None]
    xs = [x for x, _ in pairs]
    if len(set(xs)) < 2:
        return None
    ys = [y for _, y in pairs]
    linear = fit_poly(xs, ys, 1)
    quadratic = fit_poly(xs, ys, 2) if len(set(xs)) >= 3 else None
    out = MetricFits(linear, quadratic, preferred(linear, quadratic), sorted(set(xs)))
    if metric == "peak_gb" and max_gb is not None:
        out.reach_x = out.best.reach(max_gb)
    return out


Series = dict[str, dict[str, list[Measured]]]  # axis -> side -> points (sorted by x)


def analyse(series: Series, max_gb: float | None) -> dict[str, dict[str, dict[str, MetricFits | None]]]:
    """axis -> side -> metric -> its fits (None where too few points ran)."""
    return {axis: {side: {m: fit_metric(pts, m, max_gb) for m in METRICS} for side, pts in sides.items()}
            for axis, sides in series.items()}


# ---------------------------------------------------------------------------------------------- markdown
def _cell(p: Measured | None, metric: str, spec: str) -> str:
    if p is None:
        return ""
    if p.status != "ok":
        return p.status.upper()
    value = getattr(p, metric)
    return format(value, spec) if value is not None else "n/a"


def markdown(series: Series, fits: dict, titles: dict[str, str], max_gb: float | None) -> str:
    """Per axis, a table of the measured points and one of the fits, ready for benchmarks/JOURNAL.md."""
    lines: list[str] = []
    for axis, sides in series.items():
        names = list(sides)
        lines += [f"**{titles.get(axis, axis)}**", ""]
        head = ["x"] + [f"{s} s/step" for s in names] + [f"{s} peak GB" for s in names] + [f"{s} len" for s in names]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        by_label: dict[str, dict[str, Measured]] = {}
        for side, pts in sides.items():
            for p in pts:
                by_label.setdefault(p.label, {})[side] = p
        for label, row in sorted(by_label.items(), key=lambda kv: min(p.x for p in kv[1].values())):
            cells = [label] + [_cell(row.get(s), "time_s", ".3g") for s in names]
            cells += [_cell(row.get(s), "peak_gb", ".2f") for s in names]
            cells += [_cell(row.get(s), "response_len", ".0f") for s in names]
            lines.append("| " + " | ".join(cells) + " |")
        reach_head = f"x at {max_gb:g} GB" if max_gb else ""
        lines += ["", "| side | metric | linear | quadratic | preferred | quadratic share at x | dominant term at x "
                      f"| {reach_head} |", "|---|---|---|---|---|---|---|---|"]
        for side in names:
            for metric, unit in METRICS.items():
                f = fits[axis][side][metric]
                if f is None:
                    lines.append(f"| {side} | {unit} | too few points | | | | | |")
                    continue
                quad = f.quadratic
                share = ", ".join(f"{x:g}: {100 * quad.shares(x)[2]:.0f}%" for x in f.xs) if quad else ""
                dominant = ", ".join(f"{x:g}: {SHORT[f.best.dominant(x)]}" for x in f.xs)
                reach = "" if metric != "peak_gb" else ("never" if f.reach_x is None else f"{f.reach_x:.4g}")
                lines.append(f"| {side} | {unit} | {f.linear.text()} | {quad.text() if quad else ''} | "
                             f"{f.best.kind} | {share} | {dominant} | {reach} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- SVG
PANEL_W, PANEL_H, MARGIN_L, MARGIN_B, MARGIN_T, GAP = 300, 210, 58, 44, 34, 26


def _ticks(top: float) -> list[float]:
    """About five round y ticks from 0 to at least ``top``."""
    raw = top / 5 if top > 0 else 1.0
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if m * step >= raw)
    return [k * step for k in range(int(math.ceil(top / step)) + 1)]


@dataclass
class _Panel:
    left: float
    top: float
    xs: list[float]
    ymax: float

    def px(self, x: float) -> float:
        lo, hi = math.log2(min(self.xs)), math.log2(max(self.xs))
        return self.left + PANEL_W * (0.5 if hi == lo else (math.log2(x) - lo) / (hi - lo))

    def py(self, y: float) -> float:
        return self.top + PANEL_H * (1 - y / self.ymax)


def _panel(panel: _Panel, axis: str, metric: str, sides: dict[str, list[Measured]], fits: dict,
           max_gb: float | None) -> list[str]:
    out = [f'<rect x="{panel.left}" y="{panel.top}" width="{PANEL_W}" height="{PANEL_H}" fill="none" '
           f'stroke="#888"/>',
           f'<text x="{panel.left + PANEL_W / 2}" y="{panel.top - 10}" text-anchor="middle" font-size="13">'
           f'{escape(METRICS[metric])} vs {escape(axis)}</text>']
    for t in _ticks(panel.ymax):
        y = panel.py(t)
        out.append(f'<line x1="{panel.left - 4}" y1="{y:.1f}" x2="{panel.left}" y2="{y:.1f}" stroke="#888"/>'
                   f'<text x="{panel.left - 7}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{t:g}</text>')
    for x in panel.xs:  # ticks at the measured xs, labelled with x (a model's name would not fit)
        X = panel.px(x)
        out.append(f'<line x1="{X:.1f}" y1="{panel.top + PANEL_H}" x2="{X:.1f}" y2="{panel.top + PANEL_H + 4}" '
                   f'stroke="#888"/><text x="{X:.1f}" y="{panel.top + PANEL_H + 16}" text-anchor="middle" '
                   f'font-size="10">{x:.3g}</text>')
    notes = []
    for side, pts in sides.items():
        colour = SIDE_COLOURS.get(side, "#2ca02c")
        ok = [(p.x, v) for p in pts if (v := p.value(metric)) is not None]
        if ok:
            coords = " ".join(f"{panel.px(x):.1f},{panel.py(v):.1f}" for x, v in ok)
            out.append(f'<polyline class="series" data-series="{axis}/{metric}/{side}" points="{coords}" '
                       f'fill="none" stroke="{colour}" stroke-width="2"/>')
            out += [f'<circle cx="{panel.px(x):.1f}" cy="{panel.py(v):.1f}" r="3" fill="{colour}"/>' for x, v in ok]
        for p in pts:
            if p.status != "ok":  # a point that did not finish: a cross at the top, its status beside it
                X, Y = panel.px(p.x), panel.top + 10
                out.append(f'<text x="{X:.1f}" y="{Y}" text-anchor="middle" font-size="12" fill="{colour}">×'
                           f'<title>{escape(side)} {escape(p.label)}: {escape(p.status)}</title></text>')
        f = fits[axis][side][metric]
        if f is not None:
            lo, hi = min(f.xs), max(f.xs)
            grid = [lo * (hi / lo) ** (k / 40) for k in range(41)] if lo > 0 else [lo + (hi - lo) * k / 40
                                                                                   for k in range(41)]
            d = " ".join(f"{'M' if k == 0 else 'L'}{panel.px(x):.1f},{panel.py(min(max(f.best(x), 0), panel.ymax)):.1f}"
                         for k, x in enumerate(grid))
            out.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-dasharray="4 3" stroke-width="1"/>')
            if metric == "peak_gb" and max_gb:
                notes.append(f"{side}: {max_gb:g} GB at " + ("never" if f.reach_x is None else f"{f.reach_x:.3g}"))
    for k, note in enumerate(notes):
        out.append(f'<text x="{panel.left + 6}" y="{panel.top + 26 + 13 * k}" font-size="10">{escape(note)}</text>')
    return out


def svg(series: Series, fits: dict, titles: dict[str, str], max_gb: float | None) -> str:
    """A figure: one column per axis, rows time and memory; per side one polyline of the measured points (circles),
    its preferred fit dashed, points that did not finish as crosses at the top; the x axes are log2."""
    axes = [a for a in series if any(p.x > 0 for pts in series[a].values() for p in pts)]
    width = len(axes) * (PANEL_W + MARGIN_L + GAP) + GAP
    height = len(METRICS) * (PANEL_H + MARGIN_T + MARGIN_B) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    for col, axis in enumerate(axes):
        sides = series[axis]
        xs = sorted({p.x for pts in sides.values() for p in pts if p.x > 0})
        for row, metric in enumerate(METRICS):
            values = [v for pts in sides.values() for p in pts if (v := p.value(metric)) is not None]
            ymax = max(_ticks(max(values) * 1.1 if values else 1.0)[-1], 1e-9)
            left = GAP + MARGIN_L + col * (PANEL_W + MARGIN_L + GAP)
            top = 40 + MARGIN_T + row * (PANEL_H + MARGIN_T + MARGIN_B)
            out += _panel(_Panel(left, top, xs, ymax), axis, metric, sides, fits, max_gb)
            if row == len(METRICS) - 1:
                out.append(f'<text x="{left + PANEL_W / 2}" y="{top + PANEL_H + 34}" text-anchor="middle" '
                           f'font-size="11">{escape(titles.get(axis, axis))} (log scale)</text>')
    for k, (side, colour) in enumerate(SIDE_COLOURS.items()):
        x = GAP + k * 130
        out.append(f'<line x1="{x}" y1="18" x2="{x + 24}" y2="18" stroke="{colour}" stroke-width="2"/>'
                   f'<text x="{x + 30}" y="22" font-size="12">{escape(side)}</text>')
    out.append(f'<text x="{GAP + 270}" y="22" font-size="11">dashed: preferred fit; ×: did not finish</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
