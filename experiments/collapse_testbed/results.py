"""Read a testbed experiment back (``experiment.py``) into tables: ``results.json``.

- ``arms``: final held-out figures per arm (mean and sd over seeds): accuracy (c/n), pass@k, per type, the niches,
  and the final *unconditioned* strategy shares (parser labels on the evaluation samples);
- ``paired``: every arm against GRPO on the same problems (per-problem scores averaged over the seeds
  both have), paired bootstrap CI and permutation p, Holm-corrected across arms;
- ``curves``: per arm and step, the mean over seeds of the training figures;
- ``warning``: per probed run, the step at which each signal crosses its calibrated threshold and the
  steps of the ground-truth events, with lead = event step - signal step (positive = the signal warns).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from meshrl.testbed.measure import eval_shares

log = logging.getLogger("meshrl")

#: signal -> (probe key, direction of collapse). Thresholds: mean +- 3 sd over the warm-start probes.
SIGNALS: dict[str, tuple[str, str]] = {
    **{f"MEI {f}": (f"mei/{f}", "up") for f in ("bias", "head", "full")},
    **{f"MEI {f} (distinct rollouts)": (f"mei_distinct/{f}", "up") for f in ("bias", "head")},
    **{f"effective dirs {f}": (f"eff_dirs/{f}", "down") for f in ("bias", "head", "full")},
    "entropy": ("entropy", "down"),
    **{f"kernel max mass {f}": (f"kernel_max_mass/{f}@0.2", "up") for f in ("bias", "head", "full")},
    "weakest procedure log-prob": ("ref_logp/min", "down"),
}
#: ground-truth events: (probe key, direction, fixed threshold or None = calibrated like a signal)
EVENTS: dict[str, tuple[str, str, float | None]] = {
    "true max mass > 0.8": ("true_max_mass", "up", 0.8),
    "niche accuracy falls": ("acc/niche_min", "down", None),
}


def _with_niche_min(row: dict[str, Any], niches: tuple[str, ...] = ("carry", "decade")) -> dict[str, Any]:
    """Add ``acc/niche_min``: the accuracy of the worse niche type (a collapse kills one niche while the
    other may improve, so their mean can hide it)."""
    vals = [row[k] for k in (f"acc/type/{t}" for t in niches) if k in row and row[k] == row[k]]
    return {**row, "acc/niche_min": min(vals) if vals else math.nan}


def experiment_task(out: Path, **options: Any):
    """The task of the experiment in ``out`` (``settings.json``'s ``task``; ``testbed:add`` when it names none)."""
    import meshrl.testbed  # noqa: F401  (registers the testbed tasks)
    from meshrl.tasks import load_task

    path = out / "settings.json"
    name = json.loads(path.read_text()).get("task", "testbed:add") if path.is_file() else "testbed:add"
    return load_task(name, **options)


#: warm-start probes that calibrate each signal's threshold (``experiment.baseline_probes``)
BASELINE_PROBES = 5
NICHE_FALL_AT = 0.1  # the warm start is at about 0.4 on the decade niche; lost seeds end at 0.002-0.025


def niche_events(task, fall_at: float = NICHE_FALL_AT) -> dict[str, tuple[str, str, float | None]]:
    """The ground-truth events: ``EVENTS`` and the headline niche's fall below ``fall_at`` (the fall that
    a seed which ends "lost" goes through; fixed, well under the warm start's accuracy there)."""
    return {**EVENTS, f"{task.headline_niche} accuracy < {fall_at:g}": (f"acc/type/{task.headline_niche}", "down",
                                                                         fall_at)}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample sd of the finite values (NaN sd for fewer than two)."""
    from meshrl.analysis._common import finite_stats

    mean, sd, _ = finite_stats(values)
    return mean, sd


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, or none when a run has not written it."""
    from meshrl.jsonl import read_jsonl

    return read_jsonl(path) if path.is_file() else []


def _runs(out: Path) -> dict[str, dict[int, Path]]:
    runs: dict[str, dict[int, Path]] = defaultdict(dict)
    for d in sorted((out / "runs").glob("*/seed_*")):
        if (d / "eval" / "eval.json").is_file():
            runs[d.parent.name][int(d.name.split("_")[1])] = d
    return runs


def arm_table(out: Path) -> dict[str, Any]:
    task = experiment_task(out)
    table: dict[str, Any] = {}
    for arm, seeds in _runs(out).items():
        per_seed = []
        for seed, d in sorted(seeds.items()):
            ev = json.loads((d / "eval" / "eval.json").read_text())
            groups = ev.get("by", {}).get("groups", {})
            niche_n = sum(groups[t]["problems"] for t in task.niche_types if t in groups)
            niche = sum(groups[t]["pass@1"] * groups[t]["problems"] for t in task.niche_types if t in groups)
            metrics = _read_jsonl(d / "metrics.jsonl")
            per_seed.append({
                "seed": seed, **{k: v for k, v in ev["overall"].items() if k != "problems"},
                # accuracy = pass@1 = c/n over the n samples (the unbiased, lowest-variance estimate)
                "acc": ev["overall"]["pass@1"], **{f"acc/{t}": g["pass@1"] for t, g in groups.items()},
                "acc/niche": niche / niche_n if niche_n else math.nan,
                "shares": eval_shares(d / "eval", task),
                "train_seconds": sum(m.get("time/step_s", 0.0) for m in metrics),
                "rollouts": sum(m.get("rollouts/count", 0.0) for m in metrics),
            })
        keys = [k for k in per_seed[0] if k not in ("seed", "shares")]
        row: dict[str, Any] = {"seeds": [p["seed"] for p in per_seed]}
        for k in keys:
            row[k], row[f"{k}_sd"] = _mean_sd([p[k] for p in per_seed])
        row["problem_max_mass"], row["problem_max_mass_sd"] = _mean_sd(
            [p["shares"]["problem_max_mass"] for p in per_seed])
        row["shares_by_type"] = {t: {s: _mean_sd([p["shares"]["by_type"].get(t, {}).get(s, math.nan)
                                                  for p in per_seed])[0] for s in (*task.strategies, "other")}
                                 for t in per_seed[0]["shares"]["by_type"]}
        row["per_seed"] = per_seed
        table[arm] = row
    return table


def _per_problem(eval_dir: Path, metric: str) -> dict[str, float]:
    from meshrl.evaluation.compare import per_problem_scores

    return per_problem_scores(json.loads((eval_dir / "eval.json").read_text()), metric)


def paired_vs(out: Path, baseline: str = "grpo", metrics: tuple[str, ...] = ("mean", "pass@8"),
              n_boot: int = 5000) -> dict[str, Any]:
    """Each arm vs ``baseline``, paired by (seed, problem) over the seeds both arms have."""
    from meshrl.stats import holm_correction, paired_bootstrap, paired_permutation_test

    runs = _runs(out)
    if baseline not in runs:
        return {}
    res: dict[str, Any] = {}
    for metric in metrics:
        rows = {}
        for arm, seeds in runs.items():
            common = sorted(set(seeds) & set(runs[baseline]))
            if arm == baseline or not common:
                continue
            # Each seed's evaluation draws its own 256 held-out problems: pair within a seed, and pool the
            # (seed, problem) pairs as the units of the test.
            sa, sb = [], []
            for s in common:
                a, b = _per_problem(seeds[s] / "eval", metric), _per_problem(runs[baseline][s] / "eval", metric)
                pids = sorted(set(a) & set(b))
                sa += [a[p] for p in pids]
                sb += [b[p] for p in pids]
            pids = sa  # the number of paired units, for the record
            boot = paired_bootstrap(sa, sb, n_boot=n_boot, seed=0)
            rows[arm] = {"seeds": common, "pairs": len(pids), "arm": boot.mean_a, "baseline": boot.mean_b,
                         "diff": boot.diff, "ci_low": boot.ci_low, "ci_high": boot.ci_high,
                         "p_bootstrap": boot.p_value, "p_permutation": paired_permutation_test(sa, sb, seed=0)}
        if rows:
            adjusted, reject = holm_correction([r["p_permutation"] for r in rows.values()])
            for r, p, rej in zip(rows.values(), adjusted, reject, strict=True):
                r["p_holm"], r["significant"] = float(p), bool(rej)
        res[metric] = rows
    return res


def curves(out: Path, keys: tuple[str, ...] = ("reward/mean", "strategy/max_mass", "acc/type/carry",
                                              "acc/type/decade", "acc/type/low", "mei/query",
                                              "mei/effective_dirs", "entropy/mean", "mesh/grad_ratio")
           ) -> dict[str, dict[str, list[float]]]:
    res: dict[str, dict[str, list[float]]] = {}
    for arm, seeds in _runs(out).items():
        series = [_read_jsonl(d / "metrics.jsonl") for d in seeds.values()]
        steps = min(len(s) for s in series)
        res[arm] = {k: [_mean_sd([s[i].get(k, s[i].get(RENAMED.get(k, k), math.nan)) for s in series])[0]
                        for i in range(steps)] for k in keys}
    return res


def thresholds(out: Path, events: dict[str, tuple[str, str, float | None]] | None = None,
               niches: tuple[str, ...] = ("carry", "decade")) -> dict[str, tuple[float, str]]:
    """Calibrated threshold per signal (and per calibrated event) from the warm-start probes."""
    from meshrl.testbed.signals import calibrated_threshold

    base = [_with_niche_min(b, niches) for b in _read_jsonl(out / "baseline_probes.jsonl")]
    th: dict[str, tuple[float, str]] = {}
    for name, (key, direction) in SIGNALS.items():
        if base and all(key in b for b in base):  # a signal the probes did not compute (probe_features) is left out
            th[name] = (calibrated_threshold([b[key] for b in base], direction), direction)
    for name, (key, direction, fixed) in (events or EVENTS).items():
        th[name] = (fixed if fixed is not None else calibrated_threshold([b[key] for b in base], direction),
                    direction)
    return th


def warning_table(out: Path, patience: int = 1) -> dict[str, Any]:
    """Per probed run: crossing step of every signal and event; lead = event - signal (None if either never
    crosses). Aggregated per signal: runs where it crossed, mean and range of the lead over runs."""
    from meshrl.testbed.signals import first_crossing

    if not (out / "baseline_probes.jsonl").is_file():
        return {}
    task = experiment_task(out)
    events = niche_events(task)
    th = thresholds(out, events, task.niche_types)
    keys = {**{n: k for n, (k, _) in SIGNALS.items() if n in th}, **{n: k for n, (k, _, _) in events.items()}}
    per_run = []
    for arm, seeds in _runs(out).items():
        for seed, d in sorted(seeds.items()):
            probes = sorted((_with_niche_min(r, task.niche_types) for r in _read_jsonl(d / "probes.jsonl")),
                            key=lambda r: r["step"])
            probes = [p for p in probes if p["step"] > 0]  # events and warnings are changes after the start
            if not probes:
                continue
            steps = [p["step"] for p in probes]
            cross = {n: first_crossing(steps, [p.get(k, math.nan) for p in probes], th[n][0], th[n][1], patience)
                     for n, k in keys.items()}
            per_run.append({"arm": arm, "seed": seed, "dir": str(d), "crossings": cross,
                            "final": {n: probes[-1].get(k) for n, k in keys.items()}})
    return {"thresholds": {k: {"value": v, "direction": d} for k, (v, d) in th.items()}, "runs": per_run,
            "summary": lead_summary(per_run, tuple(n for n in SIGNALS if n in th), tuple(events))}


def lead_summary(per_run: list[dict[str, Any]], signals: tuple[str, ...], events: tuple[str, ...]
                 ) -> dict[str, Any]:
    """Per (signal, event): runs where each crossed, and the lead = event step - signal step over the runs
    where both did (mean, min, max; positive = the signal warns first)."""
    summary: dict[str, Any] = {}
    for event in events:
        for sig in signals:
            leads = [r["crossings"][event] - r["crossings"][sig] for r in per_run
                     if r["crossings"][event] is not None and r["crossings"][sig] is not None]
            summary[f"{sig} | {event}"] = {
                "runs": len(per_run), "event_seen": sum(r["crossings"][event] is not None for r in per_run),
                "signal_seen": sum(r["crossings"][sig] is not None for r in per_run), "both": len(leads),
                "lead_mean": _mean_sd(leads)[0] if leads else None,
                "lead_min": min(leads) if leads else None, "lead_max": max(leads) if leads else None}
    return summary


#: metric keys renamed since the committed runs were logged: old name -> new name (the paper's G/MEI)
RENAMED = {"mei/effective_dirs": "mei/g_over_mei"}
#: per-step signals in the training log (online MEI is the bias map over each query's G rollouts; "effective dirs"
#: is the paper's G/MEI, logged as mei/effective_dirs by the committed runs and as mei/g_over_mei since)
TRAIN_SIGNALS: dict[str, tuple[str, str]] = {"MEI bias (online)": ("mei/query", "up"),
                                             "effective dirs (online)": ("mei/effective_dirs", "down"),
                                             "entropy (training)": ("entropy/mean", "down"),
                                             "overall max mass (training)": ("strategy/max_mass", "up")}


DERIVED = "derived.json"  # per-run series kept by a pack in place of the training rollouts (pack.py)


def _derived(run_dir: Path, key: str) -> dict[int, Any] | None:
    """A per-step series that a pack stored instead of ``samples.jsonl`` (None when the rollouts are there)."""
    if (run_dir / "samples.jsonl").is_file() or not (run_dir / DERIVED).is_file():
        return None
    return {int(k): v for k, v in json.loads((run_dir / DERIVED).read_text()).get(key, {}).items()}


def _training_truth(run_dir: Path, task) -> dict[int, float]:
    """Step -> mean over the step's problems of the per-problem max strategy share (all rollouts)."""
    stored = _derived(run_dir, "training_truth")
    if stored is not None:
        return stored
    groups: dict[int, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for r in _read_jsonl(run_dir / "samples.jsonl"):
        groups[r["step"]][r["problem_id"]][task.label_strategy(r["completion"]) or "other"] += 1
    return {step: sum(max(c.values()) / sum(c.values()) for c in g.values()) / len(g)
            for step, g in sorted(groups.items())}


def training_warning_table(out: Path, arms: tuple[str, ...] | None = None,
                           calib_steps: int = 5, patience: int = 2) -> dict[str, Any]:
    """Step-resolution version from the training logs of the baseline runs: thresholds are mean +- 3 sd of
    each signal over the run's first ``calib_steps`` steps; events are the per-problem max strategy share
    of the training rollouts passing 0.8 and the training niche accuracy falling below its calibrated
    threshold, both for ``patience`` consecutive steps (single steps are noisy)."""
    from meshrl.testbed.signals import calibrated_threshold, first_crossing

    task = experiment_task(out)
    if arms is None:  # the probed arms of the experiment (the first experiment: the four GRPO-family baselines)
        settings = json.loads((out / "settings.json").read_text()) if (out / "settings.json").is_file() else {}
        arms = tuple(settings.get("probe_arms", ("grpo", "dapo", "grpo_kl", "grpo_js")))
    fall = f"{task.headline_niche} accuracy < {NICHE_FALL_AT:g}"
    runs, per_run, skipped = _runs(out), [], []
    for arm in arms:
        for seed, d in sorted(runs.get(arm, {}).items()):
            metrics = _read_jsonl(d / "metrics.jsonl")
            if len(metrics) < 2:  # no per-run calibration from fewer than two steps: recorded, not crashed on
                log.warning("warning table: %s seed %d has %d logged step(s); skipped", arm, seed, len(metrics))
                skipped.append({"arm": arm, "seed": seed, "steps": len(metrics)})
                continue
            truth = _training_truth(d, task)
            steps = [m["step"] for m in metrics]
            niche = [_with_niche_min(m, task.niche_types)["acc/niche_min"] for m in metrics]
            cross: dict[str, int | None] = {
                "true max mass > 0.8": first_crossing(steps, [truth.get(s, math.nan) for s in steps], 0.8, "up",
                                                      patience),
                "niche accuracy falls": first_crossing(
                    steps, niche, calibrated_threshold(niche[:calib_steps], "down"), "down", patience),
                fall: first_crossing(steps, [m.get(f"acc/type/{task.headline_niche}", math.nan) for m in metrics],
                                     NICHE_FALL_AT, "down", patience)}
            for name, (key, direction) in TRAIN_SIGNALS.items():
                vals = [m.get(key, m.get(RENAMED.get(key, key), math.nan)) for m in metrics]
                th = calibrated_threshold(vals[:calib_steps], direction)
                cross[name] = first_crossing(steps[calib_steps:], vals[calib_steps:], th, direction, patience)
            per_run.append({"arm": arm, "seed": seed, "crossings": cross})
    return {"runs": per_run, "skipped": skipped,
            "summary": lead_summary(per_run, tuple(TRAIN_SIGNALS), ("true max mass > 0.8", "niche accuracy falls",
                                                                    fall))}


def partition_agreement(out: Path) -> dict[str, Any]:
    """ARI of the kernel epsilon-partition against parser labels, per feature map and epsilon: at the warm
    start (baseline probes) and at the last probe of the probed runs."""
    from meshrl.testbed.signals import EPSILONS, FEATURES

    base = _read_jsonl(out / "baseline_probes.jsonl")
    finals = [sorted(_read_jsonl(d / "probes.jsonl"), key=lambda r: r["step"])[-1]
              for seeds in _runs(out).values() for d in seeds.values() if (d / "probes.jsonl").is_file()]
    res: dict[str, Any] = {}
    for label, rows in (("warm_start", base), ("final", finals)):
        if not rows:
            continue
        res[label] = {"probes": len(rows),
                      "distinct_frac": _mean_sd([r.get("distinct_frac", math.nan) for r in rows])[0],
                      "true_max_mass": _mean_sd([r["true_max_mass"] for r in rows])[0]}
        for f in FEATURES:
            for e in EPSILONS:
                for kind in ("ari", "pooled_ari"):
                    key = f"{kind}/{f}@{e:g}"
                    res[label][key] = _mean_sd([r.get(key, math.nan) for r in rows])[0]
    return res


def coach_following_run(out: Path, arm: str, seed: int, d: Path, task) -> dict[int, tuple[float, float | None]]:
    """Step -> (share of the run's conditioned rollouts that follow their prefix, share of its correct ones that
    do not; None without a correct one)."""
    from experiments.collapse_testbed.tables import prefix_procedures

    stored = _derived(d, "coach_following")
    if stored is not None:
        return {step: (v[0], v[1]) for step, v in stored.items()}
    per_step: dict[int, list[tuple[bool, bool]]] = defaultdict(list)
    named = prefix_procedures(out, arm, seed)  # problem id -> the procedure each prefix names
    for r in _read_jsonl(d / "samples.jsonl"):
        k = r.get("strategy", -1)
        if k >= 0:
            wanted = named[r["problem_id"]][k] if r["problem_id"] in named else task.strategies[k]
            per_step[r["step"]].append((task.label_strategy(r["completion"]) == wanted, r["score"] >= 1))
    out_rows: dict[int, tuple[float, float | None]] = {}
    for step, rows in sorted(per_step.items()):
        good = [f for f, ok in rows if ok]
        out_rows[step] = (sum(f for f, _ in rows) / len(rows), 1 - sum(good) / len(good) if good else None)
    return out_rows


def coach_following(out: Path, window: int = 4) -> dict[str, Any]:
    """Coach-conditioned arms: per step, the share of conditioned rollouts whose procedure is the one their
    prefix describes (prefix k = ``task.strategies[k]``, the rule coach's order), and the share of correct
    conditioned rollouts that did *not* follow their prefix; mean over seeds, first and last ``window``
    steps averaged."""
    task = experiment_task(out)
    res: dict[str, Any] = {}
    for arm, seeds in _runs(out).items():
        follow: dict[int, list[float]] = defaultdict(list)
        deviate: dict[int, list[float]] = defaultdict(list)
        for seed, d in seeds.items():
            for step, (f, dv) in coach_following_run(out, arm, seed, d, task).items():
                follow[step].append(f)
                if dv is not None:
                    deviate[step].append(dv)
        if not follow:
            continue
        steps = sorted(follow)
        f = [sum(follow[s]) / len(follow[s]) for s in steps]
        dv = [sum(deviate[s]) / len(deviate[s]) if deviate[s] else math.nan for s in steps]
        res[arm] = {"follow": f, "correct_deviating": dv,
                    "follow_first": _mean_sd(f[:window])[0], "follow_last": _mean_sd(f[-window:])[0],
                    "correct_deviating_last": _mean_sd(dv[-window:])[0]}
    return res


def _ranks(x: list[float]) -> list[float]:
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (Pearson correlation of mid-ranks; NaN if either side is constant)."""
    if len(x) != len(y):
        raise ValueError(f"lengths differ: {len(x)} vs {len(y)}")
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def mei_vs_truth(out: Path) -> dict[str, Any]:
    """MEI and effective directions per query against the true number of procedures among its rollouts,
    pooled over every probe (warm start and checkpoints): means by true count and Spearman correlations."""
    from meshrl.testbed.signals import FEATURES

    recs = _read_jsonl(out / "baseline_per_problem.jsonl")
    for seeds in _runs(out).values():
        for d in seeds.values():
            recs += [r for r in _read_jsonl(d / "probes_per_problem.jsonl") if r.get("step", 0) > 0]
    if not recs:
        return {}
    res: dict[str, Any] = {"queries": len(recs), "by_true_strategies": {}, "spearman": {}}
    for n in sorted({r["true_strategies"] for r in recs}):
        sub = [r for r in recs if r["true_strategies"] == n]
        res["by_true_strategies"][n] = {"queries": len(sub), **{
            k: _mean_sd([r.get(k, math.nan) for r in sub])[0] for f in FEATURES for k in (f"mei/{f}", f"eff_dirs/{f}")},
            "distinct_frac": _mean_sd([r["distinct_frac"] for r in sub])[0]}
    truth = [float(r["true_strategies"]) for r in recs]
    for f in FEATURES:
        for k in (f"mei/{f}", f"eff_dirs/{f}"):
            pairs = [(t, r[k]) for t, r in zip(truth, recs, strict=True) if k in r and r[k] == r[k]]
            res["spearman"][k] = spearman([p[0] for p in pairs], [p[1] for p in pairs]) if pairs else math.nan
    res["spearman"]["distinct_frac"] = spearman(truth, [r["distinct_frac"] for r in recs])
    return res


def outcome_tables(out: Path, res: dict[str, Any], k: int) -> dict[str, Any]:
    """The second experiment's tables (``tables.py``): niche outcomes per seed with exact tests, final vs
    best checkpoint, compute per arm, and which warning signals separate kept from lost runs."""
    from experiments.collapse_testbed.tables import checkpoint_table, compute_table, niche_outcomes, signal_separation

    settings = res["settings"]
    task = experiment_task(out)
    kept_at = float(settings.get("niche_kept_at", 0.5))
    outcomes = niche_outcomes(res["arms"], task.headline_niche, kept_at, k=k)
    return {"outcomes": outcomes, "checkpoints": checkpoint_table(out, task.headline_niche),
            "compute": compute_table(out),
            "separation": {"probes": signal_separation(res["warning"], outcomes),
                           "training": signal_separation(res["warning_training"], outcomes)}}


def incomplete_parts(out: Path) -> list[str]:
    """What of ``out`` is not finished: each run directory without ``done.json`` (killed, or still running:
    its evaluation may be missing, so it is left out of the tables, or its checkpoint evaluations and probes
    may be partial), and warm-start probes short of ``BASELINE_PROBES`` (the thresholds would rest on fewer)."""
    from experiments.collapse_testbed.experiment import aborted

    parts = []
    for d in sorted((out / "runs").glob("*/seed_*")):
        if d.is_dir() and (why := aborted(d)):
            parts.append(f"runs/{d.parent.name}/{d.name} (aborted by the trainer, {why}: not evaluated, left out of "
                         "the tables)")
        elif d.is_dir() and not (d / "done.json").is_file():
            state = ("evaluated; checkpoint evaluations or probes may be partial"
                     if (d / "eval" / "eval.json").is_file() else "not evaluated: left out of the tables")
            parts.append(f"runs/{d.parent.name}/{d.name} (no done.json, {state})")
    base = out / "baseline_probes.jsonl"
    have = len(_read_jsonl(base))
    if base.is_file() and have < BASELINE_PROBES:
        parts.append(f"baseline_probes.jsonl ({have} of {BASELINE_PROBES} warm-start probes: thresholds rest on "
                     "fewer)")
    return parts


def summarize_experiment(out: Path) -> dict[str, Any]:
    """Everything above into ``out/results.json``; returns it. An unfinished part (``incomplete_parts``) is
    summarized as it stands, listed under ``incomplete`` and logged as a warning."""
    settings = json.loads((out / "settings.json").read_text()) if (out / "settings.json").is_file() else {}
    k = max(settings.get("ks") or [1])
    incomplete = incomplete_parts(out)
    if incomplete:
        log.warning("%s: summarizing an incomplete experiment (rerun it to finish; the tables say so): %s", out,
                    "; ".join(incomplete))
    res = {"settings": settings, "k_max": k, **({"incomplete": incomplete} if incomplete else {}),
           "arms": arm_table(out), "paired_vs_grpo": paired_vs(out, metrics=("mean", f"pass@{k}")),
           "warning": warning_table(out), "warning_training": training_warning_table(out),
           "partition": partition_agreement(out), "mei_vs_truth": mei_vs_truth(out),
           "coach_following": coach_following(out),
           "curves": curves(out)}
    res.update(outcome_tables(out, res, k))
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    return res
