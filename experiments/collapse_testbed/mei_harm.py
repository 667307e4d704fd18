"""MEI against harm to the niche (preregistration.md, "Item 4"): does MEI, or the live doctor, warn in time?

Every rule is the pre-registration's ("Item 4: MEI on the paper's own terms" and "Definitions"); labels and fall
steps are persistence.py's (:func:`persistence.read_runs`, :func:`persistence.harm_class`), not recomputed here.

- **Threshold** (per warm start and variant): mean + 3 sd (ddof 1) of the per-query MEI of the warm start over its
  5 x 16 baseline queries (``baseline_per_problem.jsonl``), and the paper's fixed 1.013 beside it.
- **Signal** S(t): the mean over a run's probe queries of per-query MEI at probe step t > 0
  (``probes_per_problem.jsonl``). **Crossing**: the first probe step t >= 4 with S above the threshold (strictly)
  at t and at the next probe step. The doctor's "crossing" is its alarm onset: the first ``health_finding`` of
  severity alarm or warning in ``events.jsonl``.
- **Success** (per signal): a crossing at least 8 steps before the fall step in >= 70% of harmful runs, and a
  crossing at a probe step <= 152 in <= 30% of the others (dips and none); undefined without harmful runs or
  without others.
- **AUROC** of the run-level score max_t (S(t) - baseline mean) / baseline sd over probe steps 4..(fall step - 8)
  (harmful runs) or 4..152 (others); exact Mann-Whitney (ties 1/2); 95% percentile bootstrap resampling
  (warm start, seed) clusters, 10,000 resamples, fixed RNG seed. **Lead time**: fall step - crossing step.

``python -m experiments.collapse_testbed.mei_harm W2=runs/persist_W2 --out runs/mei_harm.md --json runs/mei_harm.json``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from experiments._args import named_dirs
from experiments.collapse_testbed.persistence import HORIZON, KEPT_AT, RunEndpoints, harm_class, read_runs

PAPER_THRESHOLD = 1.013  # the paper's fixed line (its models, G = 16)
SIGMAS = 3.0
FIRST_PROBE = 4  # crossings count from probe step 4 (step 0 is the warm start)
LEAD = 8  # a useful warning comes at least this many steps before the fall
OTHERS_UNTIL = 152  # the others' window ends here
HIT_RATE, FALSE_RATE = 0.70, 0.30  # success: >= 70% of harmful runs warned in time, <= 30% of others warned
N_BOOT, BOOT_SEED = 10_000, 0
VARIANTS = ("mei/bias", "mei_distinct/bias")  # the bias map: primary; the head map: secondary
SECONDARY_VARIANTS = ("mei/head", "mei_distinct/head")
THRESHOLDS = ("3sigma", "1.013")
DOCTOR = "doctor"
ALARMING = ("alarm", "warning")  # meshrl.doctor.findings.SEVERITIES, "info" left out
LABELS = ("verbatim", "after_hold")  # persistence.py's harm rule (primary) and its "harm after hold" variant
PRIMARY_SIGNAL = "mei/bias @ 3sigma"
Series = list[tuple[int, float]]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    from meshrl.jsonl import read_jsonl

    return read_jsonl(path) if path.is_file() else []


def baseline(out: Path, variants: tuple[str, ...] = VARIANTS + SECONDARY_VARIANTS) -> dict[str, dict[str, float]]:
    """Per variant: mean, sd (ddof 1) and n of the warm start's per-query values, and the two thresholds
    (``3sigma`` = mean + 3 sd, NaN without a baseline; ``1.013``)."""
    from meshrl.analysis._common import finite_stats

    recs = _jsonl(out / "baseline_per_problem.jsonl")
    res = {}
    for v in variants:
        mean, sd, n = finite_stats([r[v] for r in recs if isinstance(r.get(v), (int, float))])
        res[v] = {"mean": mean, "sd": sd, "n": n, "3sigma": mean + SIGMAS * sd, "1.013": PAPER_THRESHOLD}
    return res


def signal(run_dir: Path, variant: str) -> Series:
    """S(t) for t > 0: the mean over queries of the per-query ``variant`` (non-finite values left out). A probe
    step repeated after a resume keeps its last record per query; when ``probes.jsonl`` exists, only the steps it
    records (finished probes) count."""
    per: dict[int, dict[str, float]] = {}
    for r in _jsonl(run_dir / "probes_per_problem.jsonl"):
        if isinstance(r.get(variant), (int, float)) and math.isfinite(r[variant]):
            per.setdefault(int(r["step"]), {})[str(r.get("id"))] = float(r[variant])
    done = {int(r["step"]) for r in _jsonl(run_dir / "probes.jsonl")}
    return [(t, sum(q.values()) / len(q)) for t, q in sorted(per.items())
            if t > 0 and q and (not done or t in done)]


def crossing(series: Series, threshold: float, first: int = FIRST_PROBE) -> int | None:
    """The first probe step t >= ``first`` with S > ``threshold`` at t and at the next recorded probe step; None
    if there is none (or the threshold is NaN)."""
    for (t, s), (_, s_next) in zip(series, series[1:], strict=False):
        if t >= first and s > threshold and s_next > threshold:
            return t
    return None


def doctor_onset(run_dir: Path) -> int | None:
    """The step of the live doctor's first ``health_finding`` of severity alarm or warning (meshrl.doctor.live)."""
    from meshrl.doctor.live import FINDING_EVENT

    steps = [int(e["step"]) for e in _jsonl(run_dir / "events.jsonl")
             if e.get("event") == FINDING_EVENT and e.get("severity") in ALARMING]
    return min(steps) if steps else None


def window_end(harmful: bool, fall: int | None) -> int:
    """The last probe step of a run's window: fall step - 8 for a harmful run, 152 for the others."""
    return (fall - LEAD) if harmful and fall is not None else OTHERS_UNTIL


def mei_score(series: Series, mean: float, sd: float, end: int) -> float:
    """max over probe steps 4..``end`` of (S(t) - mean) / sd; -inf when the window holds no probe (a fall by step
    8 leaves none: the run cannot be warned in time and ranks lowest), NaN without a baseline sd."""
    if not sd > 0:
        return math.nan
    zs = [(s - mean) / sd for t, s in series if FIRST_PROBE <= t <= end]
    return max(zs) if zs else -math.inf


def auroc(pos: list[float], neg: list[float]) -> float:
    """P(score of a harmful run > score of another), ties 1/2 (Mann-Whitney U / (n_pos n_neg)); NaN if either
    group is empty."""
    if not pos or not neg:
        return math.nan
    u = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return u / (len(pos) * len(neg))


def cluster_bootstrap(items: list[tuple[Any, bool, float]], n_boot: int = N_BOOT, seed: int = BOOT_SEED,
                      ci: float = 0.95) -> dict[str, Any]:
    """Percentile interval of the AUROC of ``(cluster, harmful, score)`` items, resampling whole clusters with
    replacement (a (warm start, seed): all its runs together). Each resample's AUROC is exact (pairs weighted by
    how often their clusters were drawn). Resamples without a harmful run or without another are undefined: left
    out and counted (``undefined``)."""
    clusters = sorted({c for c, _, _ in items}, key=str)
    if not clusters:
        return {"low": math.nan, "high": math.nan, "undefined": n_boot, "n_boot": n_boot}
    index = {c: i for i, c in enumerate(clusters)}
    pos = [(index[c], s) for c, h, s in items if h]
    neg = [(index[c], s) for c, h, s in items if not h]
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(clusters), size=(n_boot, len(clusters)))
    counts = np.stack([np.bincount(row, minlength=len(clusters)) for row in draws]).astype(float)
    wp = counts[:, [c for c, _ in pos]] if pos else np.zeros((n_boot, 0))
    wn = counts[:, [c for c, _ in neg]] if neg else np.zeros((n_boot, 0))
    kernel = np.array([[(p > n) + 0.5 * (p == n) for _, n in neg] for _, p in pos]).reshape(len(pos), len(neg))
    den = wp.sum(1) * wn.sum(1)
    ok = den > 0
    values = np.einsum("bi,ij,bj->b", wp[ok], kernel, wn[ok]) / den[ok]
    low, high = np.quantile(values, [(1 - ci) / 2, (1 + ci) / 2]) if values.size else (math.nan, math.nan)
    return {"low": float(low), "high": float(high), "undefined": int((~ok).sum()), "n_boot": n_boot}


@dataclass
class RunSignals:
    warm: str
    arm: str
    seed: int
    complete: bool  # every checkpoint evaluated (persistence.py) and probes up to the horizon
    probe_steps: int
    labels: dict[str, tuple[str, int | None]]  # LABELS -> (harm / dip / none / missing, fall step)
    crossings: dict[str, int | None]  # "VARIANT @ THRESHOLD" and "doctor" -> step
    unavailable: list[str]  # signals without a threshold (no baseline) or without events.jsonl: not judged
    series: dict[str, Series] = field(default_factory=dict)


def run_signals(ep: RunEndpoints, run_dir: Path, base: dict[str, dict[str, float]],
                horizon: int = HORIZON) -> RunSignals:
    """One run's signals, crossings and labels (the variant's fall step from :func:`persistence.harm_class`)."""
    series = {v: signal(run_dir, v) for v in base}
    curve = list(zip(ep.steps, ep.niche, strict=True))
    hold = harm_class(curve, held_from=KEPT_AT) if ep.complete else ("missing", None)
    crossings: dict[str, int | None] = {f"{v} @ {k}": crossing(series[v], base[v][k]) for v in base
                                        for k in THRESHOLDS}
    crossings[DOCTOR] = doctor_onset(run_dir)
    unavailable = [f"{v} @ {k}" for v in base for k in THRESHOLDS if not math.isfinite(base[v][k])]
    unavailable += [] if (run_dir / "events.jsonl").is_file() else [DOCTOR]
    probed = series.get(VARIANTS[0], [])
    complete = ep.complete and bool(probed) and probed[-1][0] >= horizon
    return RunSignals(ep.warm, ep.arm, ep.seed, complete, len(probed),
                      {"verbatim": (ep.harm, ep.fall_step), "after_hold": hold}, crossings, unavailable, series)


def read_signals(warm: str, out: Path, horizon: int = HORIZON) -> tuple[dict[str, Any], list[RunSignals]]:
    """The warm start's baseline and thresholds, and every run persistence.py finds (partial ones included)."""
    base = baseline(out)
    return base, [run_signals(ep, out / "runs" / ep.arm / f"seed_{ep.seed}", base, horizon)
                  for ep in read_runs(warm, out, horizon)]


def _rate(k: int, n: int) -> float:
    return k / n if n else math.nan


def criterion(runs: list[RunSignals], key: str, label: str) -> dict[str, Any]:
    """The pre-registered success rule of signal ``key`` under label definition ``label``, over complete runs
    (a run whose signal is unavailable, e.g. no baseline for its 3-sigma threshold, is left out and counted)."""
    done = [r for r in runs if r.complete and key not in r.unavailable]
    harm = [r for r in done if r.labels[label][0] == "harm"]
    other = [r for r in done if r.labels[label][0] in ("dip", "none")]
    hits = [r for r in harm if r.crossings[key] is not None and r.crossings[key] <= r.labels[label][1] - LEAD]
    false = [r for r in other if r.crossings[key] is not None and r.crossings[key] <= OTHERS_UNTIL]
    leads = sorted(r.labels[label][1] - r.crossings[key] for r in harm if r.crossings[key] is not None)
    hit, fa = _rate(len(hits), len(harm)), _rate(len(false), len(other))
    verdict = ("undefined" if not harm or not other
               else "success" if hit >= HIT_RATE - 1e-12 and fa <= FALSE_RATE + 1e-12 else "failure")
    return {"signal": key, "label": label, "unavailable": sum(r.complete and key in r.unavailable for r in runs),
            "harmful": len(harm), "others": len(other), "warned_in_time": len(hits),
            "hit_rate": hit, "others_crossed": len(false), "false_rate": fa, "verdict": verdict,
            "leads": leads, "lead_median": float(np.median(leads)) if leads else math.nan,
            "lead_min": min(leads) if leads else None, "lead_max": max(leads) if leads else None}


def score_auroc(runs: list[RunSignals], bases: dict[str, dict[str, Any]], key: str, label: str,
                n_boot: int = N_BOOT, seed: int = BOOT_SEED) -> dict[str, Any]:
    """AUROC of the run-level score of ``key`` (an MEI variant: the max z in the window; the doctor: 1 if its
    onset falls at or before the window's end, else 0) with its cluster-bootstrap interval."""
    items = []
    for r in runs:
        cls, fall = r.labels[label]
        if not r.complete or cls not in ("harm", "dip", "none") or (key == DOCTOR and key in r.unavailable):
            continue
        end = window_end(cls == "harm", fall)
        if key == DOCTOR:
            onset = r.crossings[DOCTOR]
            score = float(onset is not None and onset <= end)
        else:
            b = bases[r.warm][key]
            score = mei_score(r.series[key], b["mean"], b["sd"], end)
        if score == score:
            items.append(((r.warm, r.seed), cls == "harm", score))
    pos = [s for _, h, s in items if h]
    neg = [s for _, h, s in items if not h]
    return {"signal": key, "label": label, "harmful": len(pos), "others": len(neg), "auroc": auroc(pos, neg),
            "empty_window": sum(s == -math.inf for s in pos), **cluster_bootstrap(items, n_boot, seed)}


def analyse(dirs: dict[str, Path], n_boot: int = N_BOOT) -> dict[str, Any]:
    """Thresholds, per-run crossings, criteria and AUROCs over every warm start given."""
    bases, runs = {}, []
    for warm, out in dirs.items():
        bases[warm], rs = read_signals(warm, out)
        runs += rs
    keys = [f"{v} @ {k}" for v in VARIANTS + SECONDARY_VARIANTS for k in THRESHOLDS] + [DOCTOR]
    return {"thresholds": bases, "runs": runs,
            "criteria": [criterion(runs, k, lab) for lab in LABELS for k in keys],
            "auroc": [score_auroc(runs, bases, k, lab, n_boot) for lab in LABELS
                      for k in (*VARIANTS, *SECONDARY_VARIANTS, DOCTOR)]}


def _f(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "–"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def markdown(res: dict[str, Any]) -> str:
    """Thresholds, success criteria, AUROCs and the per-run table."""
    out = ["# MEI against harm to the niche (preregistration.md)", "",
           f"Crossing: first probe step t >= {FIRST_PROBE} with S above the threshold at t and the next probe. "
           f"Success: crossing >= {LEAD} steps before the fall in >= {HIT_RATE:.0%} of harmful runs and at a probe "
           f"step <= {OTHERS_UNTIL} in <= {FALSE_RATE:.0%} of others. Primary: {PRIMARY_SIGNAL}, verbatim labels.",
           "", "| warm | variant | baseline n | mean | sd | 3 sigma | paper |", "|---|---|---|---|---|---|---|"]
    for warm, base in res["thresholds"].items():
        for v, b in base.items():
            out.append(f"| {warm} | {v} | {b['n']} | {_f(b['mean'], 4)} | {_f(b['sd'], 3)} | {_f(b['3sigma'], 4)} | "
                       f"{PAPER_THRESHOLD} |")
    out += ["", "| labels | signal | harmful | warned >= 8 steps before | others | others crossed <= 152 | "
            "verdict | lead times (median, [min, max]) | runs unavailable |", "|---|---|---|---|---|---|---|---|---|"]
    for c in res["criteria"]:
        out.append(f"| {c['label']} | {c['signal']} | {c['harmful']} | {c['warned_in_time']} ({_f(c['hit_rate'], 2)})"
                   f" | {c['others']} | {c['others_crossed']} ({_f(c['false_rate'], 2)}) | {c['verdict']} | "
                   f"{c['leads']} ({_f(c['lead_median'])}, [{_f(c['lead_min'])}, {_f(c['lead_max'])}]) | "
                   f"{c['unavailable']} |")
    out += ["", f"AUROC (harmful vs others; 95% bootstrap over (warm, seed), {N_BOOT} resamples, undefined ones "
            "left out; empty window = harmful runs falling too early to be warned, scored lowest):", "",
            "| labels | score | harmful | others | AUROC | 95% interval | undefined resamples | empty window |",
            "|---|---|---|---|---|---|---|---|"]
    for a in res["auroc"]:
        out.append(f"| {a['label']} | {a['signal']} | {a['harmful']} | {a['others']} | {_f(a['auroc'])} | "
                   f"[{_f(a['low'])}, {_f(a['high'])}] | {a['undefined']} | {a['empty_window']} |")
    keys = [f"{v} @ {k}" for v in VARIANTS for k in THRESHOLDS] + [DOCTOR]
    out += ["", "Per run (crossing steps; - = none; missing = not complete, left out):", "",
            "| warm | arm | seed | probes | class (fall) | after hold (fall) | " + " | ".join(keys) + " |",
            "|---|---|---|---|---|---|" + "---|" * len(keys)]
    for r in res["runs"]:
        (c, f), (h, hf) = r.labels["verbatim"], r.labels["after_hold"]
        state = "" if r.complete else " (missing)"
        out.append(f"| {r.warm} | {r.arm} | {r.seed} | {r.probe_steps}{state} | {c} ({_f(f)}) | {h} ({_f(hf)}) | "
                   + " | ".join("-" if r.crossings[k] is None else str(r.crossings[k]) for k in keys) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.collapse_testbed.mei_harm",
                                description="MEI (and the live doctor) against harm to the niche.")
    p.add_argument("dirs", nargs="+", metavar="WARM=DIR", help="an experiment directory per warm start")
    p.add_argument("--out", type=Path, default=Path("mei_harm.md"), help="the markdown tables")
    p.add_argument("--json", type=Path, default=None, help="also every number, as JSON")
    args = p.parse_args(argv)
    try:
        dirs = named_dirs(args.dirs)
    except ValueError as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    res = analyse(dirs)
    args.out.write_text(markdown(res))
    if args.json is not None:
        from meshrl.analysis._common import nan_to_none

        runs = [{k: v for k, v in asdict(r).items() if k != "series"} for r in res["runs"]]
        args.json.write_text(json.dumps(nan_to_none({**res, "runs": runs}), indent=1))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
