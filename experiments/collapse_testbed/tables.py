"""The second experiment's tables (README.md), read from a finished experiment directory into ``results.json``.

- ``outcomes``: per arm and seed, whether the headline niche was kept (held-out accuracy on it >=
  ``niche_kept_at``, 0.5 by default) or lost; kept/lost counts and Fisher's exact test of each arm's counts
  against GRPO's (two-sided, Holm-corrected across arms), and whether the arm meets the experiment's bar (kept in
  >= 4 of 5 seeds, i.e. >= 80% of >= 5 seeds, with mean accuracy and pass@k at least GRPO's means);
- ``checkpoints``: every evaluated checkpoint of every run (``ckpt_eval/step_N``): final and best (by
  accuracy, and by the headline niche) side by side with their steps;
- ``compute``: training seconds, rollouts, and the wall and CPU seconds each run's process spent;
- ``separation``: per warning signal, how often it crossed in the runs that kept the niche and in those
  that lost it (Fisher's exact test: does crossing tell harmful collapse from healthy routing?), and in
  how many lost runs it crossed before the niche fell.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from experiments.collapse_testbed.results import _mean_sd, _read_jsonl, _runs, experiment_task


def arm_task_options(arm: str) -> dict[str, Any]:
    """The ``task_options.*`` overrides of experiment arm ``arm`` (empty for an unknown arm)."""
    from experiments.collapse_testbed.experiment import ARMS

    opts = {}
    for item in ARMS.get(arm, []):
        key, _, raw = item.partition("=")
        if key.startswith("task_options."):
            opts[key.removeprefix("task_options.")] = yaml.safe_load(raw)
    return opts


def prefix_procedures(out: Path, arm: str, seed: int) -> dict[str, list[str | None]]:
    """Problem id -> the procedure each of its coach prefixes names, for arms whose coach is not the
    default one (``coach=applicable``: prefix k is not ``task.strategies[k]``); empty otherwise."""
    from meshrl.testbed.task import prefix_strategy

    opts = arm_task_options(arm)
    if opts.get("coach", "all") == "all":
        return {}
    task = experiment_task(out, seed=seed, **opts)
    return {p.id: [prefix_strategy(x) for x in task.coach_strategies(p)] for p in task.problems("train")}


def niche_outcomes(arms: dict[str, Any], headline: str, kept_at: float = 0.5, *, k: int = 8,
                   baseline: str = "grpo") -> dict[str, Any]:
    """Per arm: per-seed kept/lost on the ``headline`` niche, counts, Fisher vs ``baseline``, the bar."""
    from meshrl.stats import fisher_exact, holm_correction

    rows: dict[str, Any] = {}
    for arm, r in arms.items():
        per_seed = [{"seed": p["seed"], "niche_acc": p.get(f"acc/{headline}", math.nan),
                     "kept": bool(p.get(f"acc/{headline}", math.nan) >= kept_at)} for p in r["per_seed"]]
        kept = sum(p["kept"] for p in per_seed)
        rows[arm] = {"per_seed": per_seed, "kept": kept, "lost": len(per_seed) - kept, "seeds": len(per_seed)}
    base = rows.get(baseline)
    tested = [a for a in rows if base is not None and a != baseline]
    for arm in tested:
        res = fisher_exact([[rows[arm]["kept"], rows[arm]["lost"]], [base["kept"], base["lost"]]])
        rows[arm].update({"fisher_p": res.p_value, "odds_ratio": res.odds_ratio})
    if tested:
        adjusted, _ = holm_correction([rows[a]["fisher_p"] for a in tested])
        for arm, p in zip(tested, adjusted, strict=True):
            rows[arm]["fisher_p_holm"] = float(p)
    for arm, row in rows.items():
        row["meets_bar"] = _meets_bar(arms, arm, row, baseline, k)
    return {"headline_niche": headline, "kept_at": kept_at, "baseline": baseline, "arms": rows}


def _meets_bar(arms: dict[str, Any], arm: str, row: dict[str, Any], baseline: str, k: int) -> bool | None:
    """The second experiment's bar (preset ``round2``): niche kept in >= 80% of >= 5 seeds, accuracy and pass@k >=
    the baseline's means (None without a baseline)."""
    if baseline not in arms:
        return None
    b, a = arms[baseline], arms[arm]
    return bool(row["seeds"] >= 5 and row["kept"] >= 0.8 * row["seeds"] and a["acc"] >= b["acc"]
                and a.get(f"pass@{k}", -1.0) >= b.get(f"pass@{k}", math.inf))


def checkpoint_series(run_dir: Path, headline: str) -> list[dict[str, Any]]:
    """Per evaluated checkpoint of a run, by step: accuracy, pass@k, per-type accuracy."""
    rows = []
    for d in (run_dir / "ckpt_eval").glob("step_*"):
        if not (d / "eval.json").is_file():
            continue
        ev = json.loads((d / "eval.json").read_text())
        groups = ev.get("by", {}).get("groups", {})
        rows.append({"step": int(d.name.split("_")[1]), "acc": ev["overall"]["pass@1"],
                     **{f"acc/{t}": g["pass@1"] for t, g in groups.items()},
                     "niche": groups.get(headline, {}).get("pass@1", math.nan)})
    return sorted(rows, key=lambda r: r["step"])


def _best(series: list[dict[str, Any]], key: str, *, lowest: bool = False) -> dict[str, Any]:
    """The checkpoint with the highest ``key`` (the lowest with ``lowest``; NaN never wins; the earliest on ties)."""
    sign = -1.0 if lowest else 1.0
    return max(series, key=lambda r: (sign * r[key] if r[key] == r[key] else -math.inf, -r["step"]))


def checkpoint_table(out: Path, headline: str) -> dict[str, Any]:
    """Per arm: final vs best checkpoint (by accuracy and by the headline niche) and the worst one (a good
    final number after a trough is not a stable run), per seed and mean; and per evaluated step, the mean
    over the seeds evaluated there (``by_step``)."""
    table: dict[str, Any] = {}
    for arm, seeds in _runs(out).items():
        per_seed = []
        for seed, d in sorted(seeds.items()):
            series = checkpoint_series(d, headline)
            if not series:
                continue
            final, best, best_niche = series[-1], _best(series, "acc"), _best(series, "niche")
            worst = _best(series, "acc", lowest=True)
            per_seed.append({"seed": seed, "steps": [r["step"] for r in series], "acc": [r["acc"] for r in series],
                             "niche": [r["niche"] for r in series], "final_step": final["step"],
                             "final_acc": final["acc"], "final_niche": final["niche"], "best_step": best["step"],
                             "best_acc": best["acc"], "best_niche_step": best_niche["step"],
                             "best_niche": best_niche["niche"], "worst_step": worst["step"],
                             "worst_acc": worst["acc"]})
        if not per_seed:
            continue
        row: dict[str, Any] = {"per_seed": per_seed}
        for key in ("final_acc", "best_acc", "best_step", "final_niche", "best_niche", "best_niche_step",
                    "worst_acc", "worst_step"):
            row[key], row[f"{key}_sd"] = _mean_sd([p[key] for p in per_seed])
        row["by_step"] = _means_by_step(per_seed)
        table[arm] = row
    return table


def _means_by_step(per_seed: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Step -> mean accuracy and niche accuracy over the seeds that evaluated that step, and their count."""
    by: dict[int, list[tuple[float, float]]] = {}
    for p in per_seed:
        for step, acc, niche in zip(p["steps"], p["acc"], p["niche"], strict=True):
            by.setdefault(step, []).append((acc, niche))
    return {step: {"acc": _mean_sd([a for a, _ in v])[0], "niche": _mean_sd([n for _, n in v])[0], "seeds": len(v)}
            for step, v in sorted(by.items())}


def compute_table(out: Path) -> dict[str, Any]:
    """Per arm: training seconds and rollouts (``metrics.jsonl``) and the run processes' wall and CPU
    seconds (``done.json``, training + evaluations + probes), mean per run and total."""
    table: dict[str, Any] = {}
    for arm, seeds in _runs(out).items():
        per = []
        for d in seeds.values():
            metrics = _read_jsonl(d / "metrics.jsonl")
            done = json.loads((d / "done.json").read_text()) if (d / "done.json").is_file() else {}
            per.append({"train_s": sum(m.get("time/step_s", 0.0) for m in metrics),
                        "rollouts": sum(m.get("rollouts/count", 0.0) for m in metrics),
                        "wall_s": done.get("wall_s", math.nan), "cpu_s": done.get("cpu_s", math.nan)})
        table[arm] = {"runs": len(per), **{f"{k}_mean": _mean_sd([p[k] for p in per])[0] for k in per[0]},
                      **{f"{k}_total": sum(p[k] for p in per) for k in per[0]}}
    return table


def signal_separation(warning: dict[str, Any], outcomes: dict[str, Any]) -> dict[str, Any]:
    """Per signal: runs that crossed its threshold among those that kept the niche and those that lost it,
    Fisher's exact p on that 2x2 table, and the lost runs where it crossed before the niche fell."""
    from meshrl.stats import fisher_exact

    runs = (warning or {}).get("runs") or []
    if not runs:
        return {}
    kept_of = {(a, p["seed"]): p["kept"] for a, row in outcomes["arms"].items() for p in row["per_seed"]}
    events = {key.split(" | ")[1] for key in warning["summary"]}
    fall = next((e for e in sorted(events) if " accuracy < " in e), None)
    signals = [s for s in runs[0]["crossings"] if s not in events]
    res: dict[str, Any] = {"fall_event": fall, "signals": {}}
    for sig in signals:
        counts = {True: [0, 0], False: [0, 0]}  # kept -> [crossed, not crossed]
        before_fall = falls = 0
        for r in runs:
            kept = kept_of.get((r["arm"], r["seed"]))
            if kept is None:
                continue
            crossed = r["crossings"][sig] is not None
            counts[kept][0 if crossed else 1] += 1
            fell = fall is not None and r["crossings"].get(fall) is not None
            if not kept and fell:
                falls += 1
                before_fall += crossed and r["crossings"][sig] < r["crossings"][fall]
        test = fisher_exact([counts[False], counts[True]])
        res["signals"][sig] = {"lost_crossed": counts[False][0], "lost_runs": sum(counts[False]),
                               "kept_crossed": counts[True][0], "kept_runs": sum(counts[True]),
                               "fisher_p": test.p_value, "lost_with_fall": falls, "crossed_before_fall": before_fall}
    return res
