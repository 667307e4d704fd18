"""PNG plots for ``meshrl report``: several runs overlaid, one colour per run in every plot.

matplotlib (the ``report`` extra) is imported lazily and only through its object API with the Agg
canvas, so no display and no global pyplot state are involved. Each plot is written only when at least
one input has its data; runs without a metric are listed in the plot's note instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrl.errors import MissingDependency
from meshrl.report.data import STRATEGY_MASS_PREFIX, EvalData, RunData, as_number, eval_key_order

QUERY_SCALE = ("query scale (mei/query): per query over all its G rollouts (for Mesh, across all prefix "
               "groups); range [0, G], 1 = orthogonal rollouts, G = identical rollouts")
PREFIX_SCALE = ("prefix-group scale (mei/prefix_group, dashed): within each coach-prefix group of g rollouts; "
                "range [0, g]")
NO_MEI = "no MEI (not an MEI plot)"


@dataclass
class Plot:
    """One written PNG (``file`` relative to the report directory) with what the HTML says about it."""

    file: str
    title: str
    caption: str
    mei_scale: str = NO_MEI
    missing: list[str] = field(default_factory=list)  # labels of inputs without this plot's data


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise MissingDependency("meshrl report needs matplotlib for its plots: pip install 'meshrl[report]'") from e


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (7.5, 4.2)) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(nrows, ncols, squeeze=False).ravel())


def _save(fig: Any, out_dir: Path, name: str) -> str:
    fig.savefig(out_dir / name, dpi=100)
    return name


def colour(i: int) -> Any:
    import matplotlib

    return matplotlib.colormaps["tab10"](i % 10)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_.") or "run"


def _overlay(ax: Any, runs: Sequence[RunData], key: str, *, dashed: bool = False, suffix: str = "",
             positive: bool = False) -> list[str]:
    """Plot ``key`` of every run on ``ax``; returns the labels of runs that have it (``positive``: only
    values > 0, for log axes)."""
    have = []
    for i, run in enumerate(runs):
        xs, ys = run.series(key)
        if positive:
            xs, ys = [x for x, y in zip(xs, ys, strict=True) if y > 0], [y for y in ys if y > 0]
        if xs:
            ax.plot(xs, ys, "--" if dashed else "-", color=colour(i), marker="." if len(xs) < 30 else None,
                    label=run.label + suffix)
            have.append(run.label)
    return have


def _finish(ax: Any, ylabel: str, *, title: str | None = None, legend: bool = True) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _empty(ax: Any, key: str) -> None:
    ax.text(0.5, 0.5, f"no {key} in any run", ha="center", va="center", transform=ax.transAxes, color="grey")


def _simple(runs: Sequence[RunData], out_dir: Path, keys: Sequence[str], file: str, title: str, caption: str,
            *, logy: bool = False) -> Plot | None:
    """One subplot per key, runs overlaid; written when any run has any of the keys."""
    if not any(run.series(k)[1] and (not logy or max(run.series(k)[1]) > 0) for run in runs for k in keys):
        return None
    fig, axes = _figure(1, len(keys), (6.0 * len(keys), 4.2) if len(keys) > 1 else (7.5, 4.2))
    missing: set[str] = set()
    for ax, key in zip(axes, keys, strict=True):
        if logy:
            ax.set_yscale("log")
        have = _overlay(ax, runs, key, positive=logy)
        missing |= {r.label for r in runs} - set(have)
        if not have:
            _empty(ax, key)
        _finish(ax, key, title=key if len(keys) > 1 else title)
    return Plot(_save(fig, out_dir, file), title, caption, missing=sorted(missing))


def plot_reward_accuracy(runs: Sequence[RunData], out_dir: Path) -> Plot | None:
    return _simple(runs, out_dir, ["reward/mean", "acc/mean"], "reward_accuracy.png", "Reward and accuracy",
                   "Training-batch mean reward (reward/mean) and accuracy (acc/mean) per step.")


def plot_entropy(runs: Sequence[RunData], out_dir: Path) -> Plot | None:
    return _simple(runs, out_dir, ["entropy/mean"], "entropy.png", "Policy entropy",
                   "Mean per-token entropy of the sampled responses (entropy/mean).")


def plot_length(runs: Sequence[RunData], out_dir: Path) -> Plot | None:
    return _simple(runs, out_dir, ["len/response_mean"], "response_length.png", "Response length",
                   "Mean response length in tokens (len/response_mean).")


def plot_divergence(runs: Sequence[RunData], out_dir: Path) -> Plot | None:
    return _simple(runs, out_dir, ["kl/mean", "js/mean"], "divergence.png", "KL and JS to the reference",
                   "KL (kl/mean) and Jensen-Shannon (js/mean) divergence to the reference policy, logged by "
                   "recipes that regularise towards it.")


def plot_grad_ratio(runs: Sequence[RunData], out_dir: Path) -> Plot | None:
    return _simple(runs, out_dir, ["mesh/grad_ratio"], "grad_ratio.png", "Balancing gradient ratio",
                   "Norm of the strategy-balancing gradient over the policy-gradient norm (mesh/grad_ratio), "
                   "log scale.", logy=True)


def _scale_detail(runs: Sequence[RunData], scale: str, symbol: str) -> str:
    """Feature map and group size per run at ``scale`` ("query" or "prefix_group"), e.g. "r1: bias, G=8"."""
    parts = []
    for run in runs:
        if run.has(f"mei/{scale}"):
            feature = run.last_string("mei/feature") or "?"
            size = run.last_number(f"mei/{feature}/{scale}_group_size")
            parts.append(f"{run.label}: feature {feature}" + (f", {symbol}={size:g}" if size is not None else ""))
    return f" [{'; '.join(parts)}]" if parts else ""


def plot_mei(runs: Sequence[RunData], out_dir: Path) -> Plot | None:
    if not any(run.has("mei/query") or run.has("mei/prefix_group") for run in runs):
        return None
    fig, (ax,) = _figure()
    have = set(_overlay(ax, runs, "mei/query", suffix=" query"))
    have_prefix = _overlay(ax, runs, "mei/prefix_group", dashed=True, suffix=" prefix group")
    marks = []
    for i, run in enumerate(runs):
        threshold = run.mei_threshold()
        if threshold is not None:
            ax.axhline(threshold, color=colour(i), ls=":", lw=1.2, label=f"threshold {threshold:.4g} ({run.label})")
        step, logged = run.mei_first_crossing()
        if step is not None:
            ax.axvline(step, color=colour(i), ls="-.", lw=1.0, alpha=0.7)
            xs, ys = run.series("mei/query")
            y = next((v for x, v in zip(xs, ys, strict=True) if x == step), threshold)
            src = "logged" if logged else "from data"
            ax.plot([step], [y], marker="X", ms=10, color=colour(i), ls="none",
                    label=f"first crossing step {step:g} ({src}, {run.label})")
            marks.append(f"{run.label}: first crossing at step {step:g} ({src})")
    _finish(ax, "MEI", title="MEI (Mirrored Entanglement Index)")
    scale = QUERY_SCALE + _scale_detail(runs, "query", "G")
    if have_prefix:
        scale += "; " + PREFIX_SCALE + _scale_detail(runs, "prefix_group", "g")
    caption = ("MEI per step; dotted lines are warning thresholds (they apply to the query scale), "
               "X marks and dash-dot lines the first crossing. " + (" ".join(marks) if marks else
                                                                     "No threshold crossing recorded."))
    missing = sorted({r.label for r in runs} - have - set(have_prefix))
    return Plot(_save(fig, out_dir, "mei.png"), "MEI", caption, mei_scale=scale, missing=missing)


#: The effective-directions series the report plots: the mean over queries of the participation ratio of each
#: query's Gram spectrum (solid, ``mei/directions``: a count in [1, G]). Runs logged before it existed have only
#: the paper's G/MEI (its median over queries, else its mean), drawn dotted and named so in the caption: G/MEI is
#: no count (it exceeds G for anti-aligned rollouts, and one near-orthogonal group dominates its mean).
DIRECTIONS_KEY = "mei/directions"
LEGACY_G_OVER_MEI = ("mei/effective_dirs_median", "mei/effective_dirs")


def plot_effective_dirs(runs: Sequence[RunData], out_dir: Path) -> Plot | None:
    if not any(run.has(k) for run in runs for k in (DIRECTIONS_KEY, *LEGACY_G_OVER_MEI)):
        return None
    fig, (ax,) = _figure()
    have = set(_overlay(ax, runs, DIRECTIONS_KEY, suffix=" mean over queries"))
    legacy = []
    for i, run in enumerate(runs):
        key = next((k for k in LEGACY_G_OVER_MEI if run.has(k)), None)
        if run.label in have or key is None:
            continue
        xs, ys = run.series(key)
        ax.plot(xs, ys, ":", color=colour(i), label=f"{run.label} G/MEI (older run, not a count)")
        have.add(run.label)
        legacy.append(key)
    have_prefix = []
    for i, run in enumerate(runs):
        keys = run.keys_with_prefix("mei/")
        key = next((k for k in keys if k.endswith("/prefix_group_directions")), None)
        xs, ys = run.series(key) if key else ([], [])
        if xs:
            ax.plot(xs, ys, "--", color=colour(i), label=f"{run.label} prefix group")
            have_prefix.append(run.label)
    _finish(ax, "effective directions", title="Effective update directions")
    scale = ("query scale: solid = mean over queries of the effective directions (mei/directions: the "
             "participation ratio of the query's Gram spectrum, between 1 and G, the rollouts per query)")
    if legacy:
        scale += (f"; dotted: runs logged before it, the paper's G / MEI ({', '.join(sorted(set(legacy)))}), "
                  "which is no count: it exceeds G when rollouts are anti-aligned")
    if have_prefix:
        scale += "; dashed: prefix-group scale, effective directions per prefix group, at most g"
    return Plot(_save(fig, out_dir, "effective_dirs.png"), "Effective directions",
                "Number of effectively distinct update directions among a query's rollouts: the participation "
                "ratio (sum of the Gram matrix's eigenvalues squared over the sum of their squares), 1 when every "
                "rollout pushes along one direction, G when all G are orthogonal and equally strong.",
                mei_scale=scale, missing=sorted({r.label for r in runs} - have))


def plot_strategy_masses(runs: Sequence[RunData], out_dir: Path) -> list[Plot]:
    plots = []
    for i, run in enumerate(runs):
        names = run.keys_with_prefix(STRATEGY_MASS_PREFIX)
        if not names:
            continue
        steps = sorted({s for k in names for s in run.series(k)[0]})
        stacks = []
        for k in names:
            by_step = dict(zip(*run.series(k), strict=True))
            stacks.append([by_step.get(s, 0.0) for s in steps])
        fig, (ax,) = _figure()
        ax.stackplot(steps, stacks, labels=[k.removeprefix(STRATEGY_MASS_PREFIX) for k in names], alpha=0.85)
        ax.set_title(f"Strategy masses: {run.label}")
        _finish(ax, "mass", legend=False)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        file = _save(fig, out_dir, f"strategy_mass_{i + 1}_{slug(run.name)}.png")
        plots.append(Plot(file, f"Strategy masses: {run.label}",
                          f"Stacked strategy masses (strategy/mass/<name>, {len(names)} strategies) of {run.label}; "
                          "a band that swallows the others is a collapse onto one strategy."))
    return plots


#: Held-out keys that count problems or failures rather than measure the policy: not plotted (a panel each made the
#: figure of a run with a per-type breakdown twice as large and its drawing most of the report's time).
EVAL_COUNTS = ("eval/skipped_long_prompts", "eval/reward_errors", "eval/reward_timeouts")


def _plotted_eval_key(key: str) -> bool:
    return key not in EVAL_COUNTS and not (key.startswith("eval/by/") and key.endswith("/problems"))


def plot_heldout(runs: Sequence[RunData], out_dir: Path) -> Plot | None:
    keys = sorted({k for run in runs for k in run.eval_keys() if _plotted_eval_key(k)}, key=eval_key_order)
    if not keys:
        return None
    ncols = min(3, len(keys))
    nrows = -(-len(keys) // ncols)
    fig, axes = _figure(nrows, ncols, (5.2 * ncols, 4.0 * nrows))
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    have: set[str] = set()
    for ax, key in zip(axes, keys, strict=False):
        for i, run in enumerate(runs):
            xs, ys = run.series(key, run.eval_rows())
            if not xs:
                continue
            have.add(run.label)
            ax.plot(xs, ys, "-", marker=".", color=colour(i), label=run.label)
            for which, marker in (("final", "s"), ("best", "*")):
                rec = run.held_out(which)
                value = as_number(rec.get(key)) if rec else None
                if rec and value is not None:
                    ax.plot([rec["step"]], [value], marker=marker, ms=11 if marker == "*" else 8, ls="none",
                            mfc="none" if marker == "s" else colour(i), mec=colour(i), mew=1.5,
                            label=f"{which} step {rec['step']} ({run.label})")
        _finish(ax, key, title=key)
    return Plot(_save(fig, out_dir, "eval_heldout.png"), "Held-out evaluation",
                "Periodic held-out evaluation during training (eval/*); hollow square = final evaluated step, "
                "star = best step by summary.json's selection metric.",
                missing=sorted({r.label for r in runs} - have))


def plot_pass_at_k(evals: Sequence[EvalData], out_dir: Path) -> Plot | None:
    if not any(ev.at_k("pass") for ev in evals):
        return None
    fig, (ax,) = _figure()
    ks: set[int] = set()
    have = []
    for i, ev in enumerate(evals):
        points = ev.at_k("pass")
        if points:
            ks |= {k for k, _ in points}
            ax.plot([k for k, _ in points], [v for _, v in points], "-o", color=colour(i), label=ev.label)
            have.append(ev.label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ks), [str(k) for k in sorted(ks)])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("k (log2)")
    ax.set_ylabel("pass@k")
    ax.set_title("pass@k (unbiased estimator)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return Plot(_save(fig, out_dir, "pass_at_k.png"), "pass@k",
                "Overall unbiased pass@k of each eval directory (eval.json), k on a log2 axis.",
                missing=sorted({e.label for e in evals} - set(have)))


def make_plots(runs: Sequence[RunData], evals: Sequence[EvalData], out_dir: Path) -> list[Plot]:
    """Write every plot that has data into ``out_dir``; returns them in page order."""
    require_matplotlib()
    plots: list[Plot | None] = [plot_reward_accuracy(runs, out_dir), plot_heldout(runs, out_dir),
                                plot_mei(runs, out_dir), plot_effective_dirs(runs, out_dir)]
    plots += plot_strategy_masses(runs, out_dir)
    plots += [plot_entropy(runs, out_dir), plot_length(runs, out_dir), plot_divergence(runs, out_dir),
              plot_grad_ratio(runs, out_dir), plot_pass_at_k(evals, out_dir)]
    return [p for p in plots if p is not None]
