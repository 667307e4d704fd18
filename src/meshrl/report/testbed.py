"""Tables (markdown) and figures (PNG) of a testbed experiment's ``results.json`` (docs/testbed.md)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from meshrl.report.plots import _figure, _save, colour, require_matplotlib

TYPES = ("low", "carry", "decade")


def _f(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _pm(row: dict[str, Any], key: str) -> str:
    return f"{_f(row.get(key))} ± {_f(row.get(key + '_sd'), 3)}"


def arms_markdown(res: dict[str, Any]) -> str:
    """Final held-out accuracy per arm (mean ± sd over seeds) and the final unconditioned shares."""
    k = res.get("k_max", 8)
    lines = [f"| arm | seeds | accuracy | pass@{k} | low | carry | decade | niche | per-problem max mass |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, r in res["arms"].items():
        lines.append(f"| {arm} | {len(r['seeds'])} | {_pm(r, 'acc')} | {_pm(r, f'pass@{k}')} | "
                     + " | ".join(_pm(r, f"acc/{t}") for t in TYPES)
                     + f" | {_pm(r, 'acc/niche')} | {_pm(r, 'problem_max_mass')} |")
    lines += ["", "Final unconditioned strategy shares (c / t / r) per problem type, mean over seeds:", "",
              "| arm | low | carry | decade |", "|---|---|---|---|"]
    for arm, r in res["arms"].items():
        cells = []
        for t in TYPES:
            sh = r["shares_by_type"].get(t, {})
            cells.append(" / ".join(_f(sh.get(s), 2) for s in ("c", "t", "r")))
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seeds_markdown(res: dict[str, Any]) -> str:
    """Per seed: held-out accuracy and, in brackets, accuracy on the ``decade`` niche (the one a collapse
    onto the generalist procedure loses)."""
    seeds = sorted({p["seed"] for r in res["arms"].values() for p in r["per_seed"]})
    lines = ["| arm | " + " | ".join(f"seed {s}: accuracy (decade)" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for arm, r in res["arms"].items():
        by = {p["seed"]: p for p in r["per_seed"]}
        lines.append(f"| {arm} | " + " | ".join(
            f"{by[s]['acc']:.3f} ({by[s].get('acc/decade', math.nan):.3f})" if s in by else "–" for s in seeds)
            + " |")
    return "\n".join(lines)


def paired_markdown(res: dict[str, Any]) -> str:
    lines = []
    for metric, rows in res.get("paired_vs_grpo", {}).items():
        lines += [f"**{metric}** (arm − GRPO, paired by seed and problem: each seed evaluates 256 held-out "
                  "problems, the same for both arms; 95% paired bootstrap CI; sign-flip permutation p, "
                  "Holm-corrected across arms):", "",
                  "| arm | arm | GRPO | diff | 95% CI | p (perm.) | p (Holm) |", "|---|---|---|---|---|---|---|"]
        for arm, r in rows.items():
            lines.append(f"| {arm} | {_f(r['arm'])} | {_f(r['baseline'])} | {r['diff']:+.3f} | "
                         f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {_f(r['p_permutation'], 4)} | "
                         f"{_f(r['p_holm'], 4)} |")
        lines.append("")
    return "\n".join(lines)


def warning_markdown(res: dict[str, Any], key: str = "warning") -> str:
    w = res.get(key) or {}
    if not w or not w.get("runs"):
        return "(no probes)"
    lines = ["| signal | threshold | event | runs where the event happened | signal crossed | lead (mean, "
             "min..max steps; + = warns first) |", "|---|---|---|---|---|---|"]
    for key, s in w["summary"].items():
        sig, event = key.split(" | ")
        th = w.get("thresholds", {}).get(sig, {"direction": "up", "value": math.nan})
        lead = ("–" if s["lead_mean"] is None else
                f"{s['lead_mean']:+.1f} ({s['lead_min']:+d}..{s['lead_max']:+d}, n={s['both']})")
        th_text = "calibrated per run" if th["value"] != th["value"] else \
            f"{'>' if th['direction'] == 'up' else '<'} {th['value']:.3g}"
        lines.append(f"| {sig} | {th_text} | {event} | "
                     f"{s['event_seen']}/{s['runs']} | {s['signal_seen']}/{s['runs']} | {lead} |")
    lines += ["", "Crossing steps per probed run (– = never within the run):", "",
              "| run | " + " | ".join(w["runs"][0]["crossings"]) + " |",
              "|---|" + "---|" * len(w["runs"][0]["crossings"])]
    for r in w["runs"]:
        lines.append(f"| {r['arm']} s{r['seed']} | " + " | ".join(_f(v) for v in r["crossings"].values()) + " |")
    return "\n".join(lines)


def partition_markdown(res: dict[str, Any]) -> str:
    from meshrl.testbed.signals import EPSILONS, FEATURES

    part = res.get("partition") or {}
    lines = []
    for label, row in part.items():
        lines += [f"**{label}** ({row['probes']} probes; distinct rollouts per query {row['distinct_frac']:.2f}, "
                  f"true per-problem max mass {row['true_max_mass']:.2f}):", "",
                  "| feature | " + " | ".join(f"ε={e:g} per query / pooled" for e in EPSILONS) + " |",
                  "|---|" + "---|" * len(EPSILONS)]
        for f in FEATURES:
            lines.append(f"| {f} | " + " | ".join(f"{_f(row.get(f'ari/{f}@{e:g}'), 2)} / "
                                                   f"{_f(row.get(f'pooled_ari/{f}@{e:g}'), 2)}" for e in EPSILONS)
                         + " |")
        lines.append("")
    return "\n".join(lines)


def mei_truth_markdown(res: dict[str, Any]) -> str:
    from meshrl.testbed.signals import FEATURES

    m = res.get("mei_vs_truth") or {}
    if not m:
        return "(no per-query probes)"
    lines = ["| true procedures in the group | queries | distinct rollouts | "
             + " | ".join(f"MEI {f} | eff. dirs {f}" for f in FEATURES) + " |",
             "|---|---|---|" + "---|---|" * len(FEATURES)]
    for n, row in m["by_true_strategies"].items():
        lines.append(f"| {n} | {row['queries']} | {_f(row['distinct_frac'], 2)} | "
                     + " | ".join(f"{_f(row[f'mei/{f}'], 2)} | {_f(row[f'eff_dirs/{f}'], 1)}" for f in FEATURES) + " |")
    sp = m["spearman"]
    lines += ["", "Spearman correlation with the true number of procedures: "
              + ", ".join(f"{k} {_f(v, 2)}" for k, v in sp.items()) + "."]
    return "\n".join(lines)


def following_markdown(res: dict[str, Any]) -> str:
    rows = res.get("coach_following") or {}
    if not rows:
        return "(no coach-conditioned arms)"
    lines = ["| arm | follows its prefix, first 4 steps | last 4 steps | correct rollouts not following it, "
             "last 4 steps |", "|---|---|---|---|"]
    for arm, r in rows.items():
        lines.append(f"| {arm} | {_f(r['follow_first'], 2)} | {_f(r['follow_last'], 2)} | "
                     f"{_f(r['correct_deviating_last'], 2)} |")
    return "\n".join(lines)


def results_markdown(res: dict[str, Any]) -> str:
    sections = [
        ("Final held-out results", arms_markdown(res)),
        ("Final held-out results per seed", seeds_markdown(res)),
        ("Paired comparisons against GRPO", paired_markdown(res)),
        ("Coach following (training rollouts of the coach-conditioned arms)", following_markdown(res)),
        ("Warning signals (checkpoint probes)", warning_markdown(res)),
        ("Warning signals (training logs, every step)", warning_markdown(res, "warning_training")),
        ("Kernel partition vs parser labels (ARI)", partition_markdown(res)),
        ("MEI and effective directions vs the true number of procedures", mei_truth_markdown(res)),
    ]
    return "\n\n".join(f"### {title}\n\n{body}" for title, body in sections)


def plot_results(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """Three PNGs: training curves per arm, final accuracy by type, and the probed signals over steps."""
    require_matplotlib()
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    curves = res["curves"]
    fig, axes = _figure(2, 2, size=(12, 7.5))
    for (ax, key, label) in zip(axes, ("reward/mean", "strategy/max_mass", "acc/type/decade", "acc/type/carry"),
                                ("training reward", "max strategy mass (training rollouts)",
                                 "training accuracy, decade", "training accuracy, carry"), strict=True):
        for i, (arm, c) in enumerate(curves.items()):
            ax.plot(range(1, len(c[key]) + 1), c[key], color=colour(i), label=arm, lw=1.2, ls=_style(i))
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=6, ncol=2)
    files.append(out_dir / _save(fig, out_dir, "testbed_curves.png"))

    fig, axes = _figure(1, 1, size=(12, 4))
    ax = axes[0]
    arms = list(res["arms"])
    width = 0.8 / len(TYPES)
    for j, t in enumerate(TYPES):
        vals = [res["arms"][a].get(f"acc/{t}", math.nan) for a in arms]
        errs = [res["arms"][a].get(f"acc/{t}_sd", 0.0) for a in arms]
        ax.bar([i + j * width for i in range(len(arms))], vals, width, yerr=errs, label=t, color=colour(j))
    ax.set_xticks([i + width for i in range(len(arms))], arms, rotation=30, fontsize=7)
    ax.set_ylabel("held-out accuracy (c/n)")
    ax.legend(fontsize=8)
    files.append(out_dir / _save(fig, out_dir, "testbed_final_by_type.png"))

    runs = (res.get("warning") or {}).get("runs", [])
    if runs:
        files.append(out_dir / _plot_probes(res, out_dir))
    return files


def _style(i: int) -> str:
    """Line style per series: colours repeat after ten, styles tell the repeats apart."""
    return ("-", "--", ":", "-.")[(i // 10) % 4]


def _plot_probes(res: dict[str, Any], out_dir: Path) -> str:
    """Per probed run: true per-problem max mass, niche accuracy and MEI (bias) against the step."""
    import json

    fig, axes = _figure(1, 3, size=(13, 3.8))
    for i, run in enumerate(res["warning"]["runs"]):
        path = Path(run.get("dir", "")) / "probes.jsonl" if run.get("dir") else None
        if path is None or not path.is_file():
            continue
        rows = sorted((json.loads(x) for x in path.read_text().splitlines() if x.strip()), key=lambda r: r["step"])
        steps = [r["step"] for r in rows]
        for ax, key in zip(axes, ("true_max_mass", "acc/type/decade", "mei/bias"), strict=True):
            ax.plot(steps, [r.get(key, math.nan) for r in rows], color=colour(i), lw=1, ls=_style(i),
                    label=f"{run['arm']} s{run['seed']}")
    for ax, title in zip(axes, ("true per-problem max mass", "accuracy on the decade niche", "MEI (bias)"),
                         strict=True):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=6)
    return _save(fig, out_dir, "testbed_probes.png")
