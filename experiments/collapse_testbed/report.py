"""Tables (markdown) and figures (PNG) of a testbed experiment's ``results.json`` (README.md, results.md)."""

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


def _types(res: dict[str, Any]) -> tuple[str, ...]:
    """The problem types of the experiment's task (``testbed:add``'s three unless the arms say otherwise)."""
    for r in res.get("arms", {}).values():
        found = tuple(t for t in r.get("shares_by_type", {}) if t != "?")
        if found:
            return tuple(t for t in TYPES if t in found) + tuple(t for t in found if t not in TYPES)
    return TYPES


def arms_markdown(res: dict[str, Any]) -> str:
    """Final held-out accuracy per arm (mean ± sd over seeds) and the final unconditioned shares."""
    k = res.get("k_max", 8)
    types = _types(res)
    lines = [f"| arm | seeds | accuracy | pass@{k} | " + " | ".join(types) + " | niche | per-problem max mass |",
             "|---|---|---|---|" + "---|" * len(types) + "---|---|"]
    for arm, r in res["arms"].items():
        lines.append(f"| {arm} | {len(r['seeds'])} | {_pm(r, 'acc')} | {_pm(r, f'pass@{k}')} | "
                     + " | ".join(_pm(r, f"acc/{t}") for t in types)
                     + f" | {_pm(r, 'acc/niche')} | {_pm(r, 'problem_max_mass')} |")
    lines += ["", "Final unconditioned strategy shares (c / t / r) per problem type, mean over seeds:", "",
              "| arm | " + " | ".join(types) + " |", "|---|" + "---|" * len(types)]
    for arm, r in res["arms"].items():
        cells = []
        for t in types:
            sh = r["shares_by_type"].get(t, {})
            cells.append(" / ".join(_f(sh.get(s), 2) for s in ("c", "t", "r")))
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seeds_markdown(res: dict[str, Any]) -> str:
    """Per seed: held-out accuracy and, in brackets, accuracy on the ``decade`` niche (the one a collapse
    onto the generalist procedure loses)."""
    seeds = sorted({p["seed"] for r in res["arms"].values() for p in r["per_seed"]})
    niche = (res.get("outcomes") or {}).get("headline_niche", "decade")
    lines = ["| arm | " + " | ".join(f"seed {s}: accuracy ({niche})" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for arm, r in res["arms"].items():
        by = {p["seed"]: p for p in r["per_seed"]}
        lines.append(f"| {arm} | " + " | ".join(
            f"{by[s]['acc']:.3f} ({by[s].get(f'acc/{niche}', math.nan):.3f})" if s in by else "–" for s in seeds)
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


def outcomes_markdown(res: dict[str, Any]) -> str:
    """Per arm: the niche kept (K) or lost (L) in each seed, counts, Fisher's exact test against GRPO."""
    o = res.get("outcomes") or {}
    if not o.get("arms"):
        return "(no runs)"
    lines = [f"Niche kept = held-out accuracy on `{o['headline_niche']}` >= {o['kept_at']:g}; Fisher's exact test "
             f"(two-sided) of each arm's kept/lost counts against {o['baseline']}'s, Holm-corrected across arms; "
             "bar = kept in >= 80% of >= 5 seeds with accuracy and pass@k at least the baseline's.", "",
             "| arm | per seed (K kept, L lost) | kept / seeds | Fisher p | p (Holm) | meets the bar |",
             "|---|---|---|---|---|---|"]
    for arm, r in o["arms"].items():
        marks = " ".join(f"s{p['seed']}:{'K' if p['kept'] else 'L'}" for p in r["per_seed"])
        bar = {True: "yes", False: "no", None: "–"}[r.get("meets_bar")]
        lines.append(f"| {arm} | {marks} | {r['kept']} / {r['seeds']} | {_f(r.get('fisher_p'), 4)} | "
                     f"{_f(r.get('fisher_p_holm'), 4)} | {bar} |")
    return "\n".join(lines)


def checkpoints_markdown(res: dict[str, Any]) -> str:
    """Final vs best checkpoint per arm (mean ± sd over seeds; steps in brackets)."""
    rows = res.get("checkpoints") or {}
    if not rows:
        return "(no checkpoint evaluations)"
    niche = (res.get("outcomes") or {}).get("headline_niche", "niche")
    # results.json files written before the worst checkpoint and the per-step means were recorded (the plug-in
    # measurement's) have neither: their tables are printed without those columns, as they were committed.
    has_worst = any("worst_acc" in r for r in rows.values())
    worst_head = " worst accuracy (step) |" if has_worst else ""
    lines = [f"| arm | final accuracy | best accuracy (step) |{worst_head} final {niche} | best {niche} "
             "(step) | per seed: best step / final step |", "|---|---|---|" + "---|" * (4 if has_worst else 3)]
    for arm, r in rows.items():
        steps = ", ".join(f"{p['best_step']}/{p['final_step']}" for p in r["per_seed"])
        worst = ""
        if has_worst:
            worst = (f" {_pm(r, 'worst_acc')} ({_f(r['worst_step'], 1)}) |" if "worst_acc" in r else " – |")
        lines.append(f"| {arm} | {_pm(r, 'final_acc')} | {_pm(r, 'best_acc')} ({_f(r['best_step'], 1)}) |{worst} "
                     f"{_pm(r, 'final_niche')} | {_pm(r, 'best_niche')} ({_f(r['best_niche_step'], 1)}) | {steps} |")
    by_step = by_step_markdown(rows, niche)
    return "\n".join(lines + (["", by_step] if by_step else []))


def _by_step(row: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A checkpoint row's per-step means by int step (the keys are str once results.json is read back)."""
    return {int(k): v for k, v in sorted(row.get("by_step", {}).items(), key=lambda kv: int(kv[0]))}


def by_step_markdown(rows: dict[str, Any], niche: str) -> str:
    """Held-out accuracy (and niche accuracy) at every evaluated step, mean over the seeds evaluated there."""
    steps = sorted({s for r in rows.values() for s in _by_step(r)})
    if not steps:
        return ""
    lines = [f"Held-out accuracy ({niche} accuracy) at each evaluated checkpoint, mean over seeds:", "",
             "| arm | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for arm, r in rows.items():
        by = _by_step(r)
        cells = [f"{_f(by[s]['acc'], 2)} ({_f(by[s]['niche'], 2)})" if s in by else "–" for s in steps]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compute_markdown(res: dict[str, Any]) -> str:
    rows = res.get("compute") or {}
    if not rows:
        return "(no runs)"
    lines = ["| arm | runs | rollouts per run | training s per run | process wall s per run | CPU s per run |",
             "|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        lines.append(f"| {arm} | {r['runs']} | {_f(r['rollouts_mean'], 0)} | {_f(r['train_s_mean'], 0)} | "
                     f"{_f(r['wall_s_mean'], 0)} | {_f(r['cpu_s_mean'], 0)} |")
    return "\n".join(lines)


def separation_markdown(res: dict[str, Any], key: str) -> str:
    """Does a signal's crossing tell the runs that lost the niche from those that kept it?"""
    sep = (res.get("separation") or {}).get(key) or {}
    if not sep.get("signals"):
        return "(no probed runs with an outcome)"
    lines = [f"Fall event: `{sep['fall_event']}`.", "",
             "| signal | crossed in lost runs | crossed in kept runs | Fisher p | crossed before the fall (lost runs "
             "that fell) |", "|---|---|---|---|---|"]
    for sig, r in sep["signals"].items():
        lines.append(f"| {sig} | {r['lost_crossed']}/{r['lost_runs']} | {r['kept_crossed']}/{r['kept_runs']} | "
                     f"{_f(r['fisher_p'], 3)} | {r['crossed_before_fall']}/{r['lost_with_fall']} |")
    return "\n".join(lines)


def results_markdown(res: dict[str, Any]) -> str:
    sections = [
        ("Final held-out results", arms_markdown(res)),
        ("Niche kept or lost, per seed", outcomes_markdown(res)),
        ("Final held-out results per seed", seeds_markdown(res)),
        ("Final vs best checkpoint (held-out checkpoint evaluations)", checkpoints_markdown(res)),
        ("Compute per arm", compute_markdown(res)),
        ("Paired comparisons against GRPO", paired_markdown(res)),
        ("Coach following (training rollouts of the coach-conditioned arms)", following_markdown(res)),
        ("Warning signals (checkpoint probes)", warning_markdown(res)),
        ("Warning signals (training logs, every step)", warning_markdown(res, "warning_training")),
        ("Do the signals separate lost from kept runs? (checkpoint probes)", separation_markdown(res, "probes")),
        ("Do the signals separate lost from kept runs? (training logs)", separation_markdown(res, "training")),
        ("Kernel partition vs parser labels (ARI)", partition_markdown(res)),
        ("MEI and effective directions vs the true number of procedures", mei_truth_markdown(res)),
    ]
    text = "\n\n".join(f"### {title}\n\n{body}" for title, body in sections)
    if res.get("incomplete"):  # a summary taken from an unfinished experiment says so first
        text = "**Incomplete experiment** (rerun it to finish): " + "; ".join(res["incomplete"]) + "\n\n" + text
    return text


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
    types = _types(res)
    width = 0.8 / len(types)
    for j, t in enumerate(types):
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
    if res.get("checkpoints"):
        files.append(out_dir / _plot_checkpoints(res, out_dir))
    return files


def _plot_checkpoints(res: dict[str, Any], out_dir: Path) -> str:
    """Held-out accuracy and headline-niche accuracy at each evaluated checkpoint, mean over seeds per arm."""
    fig, axes = _figure(1, 2, size=(12, 4))
    niche = (res.get("outcomes") or {}).get("headline_niche", "niche")
    for i, (arm, row) in enumerate(res["checkpoints"].items()):
        by = _by_step(row)
        for ax, key in zip(axes, ("acc", "niche"), strict=True):
            ax.plot(list(by), [v[key] for v in by.values()], color=colour(i), ls=_style(i), lw=1.2, marker=".",
                    label=arm)
    for ax, title in zip(axes, ("held-out accuracy per checkpoint", f"held-out {niche} accuracy per checkpoint"),
                         strict=True):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=6, ncol=2)
    return _save(fig, out_dir, "testbed_checkpoints.png")


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
