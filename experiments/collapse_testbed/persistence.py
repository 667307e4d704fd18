"""The persistence experiment's endpoints and seed-level tests, as pre-registered in preregistration.md.

Per run (one arm, one seed, one warm start) from its checkpoint evaluations (``ckpt_eval/step_N/eval.json``, and
``warm_eval/seed_S/eval.json`` for step 0): the niche curve (held-out accuracy on the headline niche, ``decade``),
the outcome at the horizon (kept / borderline / lost), the time to re-learn the niche after the early dip
(censored at the horizon), the area under the niche curve, and the harm class (harm, transient dip or none).
Per pre-registered comparison (an arm against GRPO, seeds paired by seed number within a warm start): exact
sign-flip tests on the per-seed differences, McNemar's exact test on kept/lost pairs and Fisher's exact test on
kept counts, with Holm's correction over each family. The seed is the unit throughout: no test pools problems.

``python -m experiments.collapse_testbed.persistence W1=runs/persist_W1 W2=runs/persist_W2 --out persistence.md``
reads finished or partial experiment directories (a run is in the tests once every checkpoint to the horizon is
evaluated; the tables say how many runs each arm has).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from experiments._args import named_dirs

HORIZON = 160
EVERY = 8
KEPT_AT = 0.5  # the nominal line of earlier results (niche_kept_at)
BAND = (0.4, 0.6)  # [low, high]: borderline at the horizon, neither kept nor lost
DIP_WINDOW = (8, 40)  # the early dip's minimum is looked for here (the second experiment: troughs at steps 16-24)
HARM_DROP = 0.2  # a fall this far below the running maximum ...
HARM_RUN = 2  # ... for this many consecutive checkpoints is harm; a shorter one is a transient dip
RISING = 0.2  # a loss at the horizon is not persistent when the niche rose this much over the last 16 steps
PRIMARY = ("cp_only", "grpo")  # the primary comparison: arm, baseline
SECONDARY_ARMS = ("grpo_fork", "mesh_mu1e-1")  # against GRPO, as time allows
Curve = list[tuple[int, float]]


# ------------------------------------------------------------------------------------------- per run
def outcome(value: float, band: tuple[float, float] = BAND) -> str:
    """``kept`` above the band, ``lost`` below it, ``borderline`` inside it (ends included)."""
    if value != value:
        return "missing"
    return "kept" if value > band[1] else "lost" if value < band[0] else "borderline"


def relearn_time(curve: Curve, kept_at: float = KEPT_AT, window: tuple[int, int] = DIP_WINDOW,
                 horizon: int = HORIZON) -> tuple[int, bool]:
    """``(T, censored)``: T = the first checkpoint at or after the early dip's minimum with niche >= ``kept_at``.

    The dip's minimum is the lowest checkpoint in ``window`` (the earliest on ties). A run whose minimum there is
    already >= ``kept_at`` never lost the niche: T is the window's first checkpoint. No such checkpoint up to
    ``horizon``: ``(horizon, True)`` (right-censored)."""
    inside = [(s, v) for s, v in curve if window[0] <= s <= window[1] and v == v]
    if not inside:
        return horizon, True
    dip_step, dip = min(inside, key=lambda sv: (sv[1], sv[0]))
    if dip >= kept_at:
        return inside[0][0], False
    for s, v in curve:
        if dip_step <= s <= horizon and v >= kept_at:
            return s, False
    return horizon, True


def niche_auc(curve: Curve, horizon: int = HORIZON) -> float:
    """Trapezoid area under the niche curve from step 0 to ``horizon``, divided by ``horizon`` (a curve at 1
    throughout has area 1). NaN unless both ends are evaluated."""
    pts = [(s, v) for s, v in curve if 0 <= s <= horizon]
    if not pts or pts[0][0] != 0 or pts[-1][0] != horizon:
        return math.nan
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(pts, pts[1:], strict=False))
    return area / horizon


def harm_class(curve: Curve, *, drop: float = HARM_DROP, run: int = HARM_RUN, band: tuple[float, float] = BAND,
               held_from: float | None = None) -> tuple[str, int | None]:
    """``(class, fall step)``: ``harm``, ``dip`` (transient) or ``none``.

    Harm: ``run`` or more consecutive checkpoints >= ``drop`` below the running maximum (the curve's own, from its
    first point), or the niche lost at the last checkpoint (below ``band``). The fall step is the first
    checkpoint of the first such stretch, or, for a run harmful by its last point only, the first checkpoint from
    which the niche stays below ``band[0]``. A dip: a shorter stretch, the niche not lost at the end.
    ``held_from`` (the variant): the running maximum counts only from the first checkpoint >= ``held_from``, so a
    fall from a level never held (the early dip from the warm start) is not harm."""
    best, stretch, start, dipped = -math.inf, 0, None, False
    for s, v in curve:
        if held_from is not None and best == -math.inf and v < held_from:
            continue
        best = max(best, v)
        if best - v >= drop - 1e-12:  # "at least 0.2 below", up to float rounding of the accuracies
            stretch, start, dipped = stretch + 1, start if stretch else s, True
            if stretch >= run:
                return "harm", start
        else:
            stretch = 0
    if curve and outcome(curve[-1][1], band) == "lost":
        below = [s for s, v in curve if v >= band[0]]
        after = [s for s, _ in curve if not below or s > below[-1]]
        return "harm", after[0]
    return ("dip" if dipped else "none"), None


@dataclass(frozen=True)
class RunEndpoints:
    warm: str
    arm: str
    seed: int
    complete: bool  # every checkpoint 8, 16, ..., horizon evaluated
    steps: list[int]
    niche: list[float]
    final: float  # niche at the horizon (NaN if not there)
    at_horizon: str  # kept / borderline / lost / missing
    nominal_kept: bool  # >= KEPT_AT, the line of earlier results
    relearn: int
    censored: bool
    persistent_loss: bool  # below the band at every checkpoint of the last 32 steps, and not rising at the end
    auc: float
    harm: str
    fall_step: int | None
    harm_after_hold: str  # the variant: falls from a level >= KEPT_AT only
    evaluated: str = ""  # the checkpoint evaluations' seed, problems and samples: equal within a seed pair


def endpoints(warm: str, arm: str, seed: int, curve: Curve, horizon: int = HORIZON, evaluated: str = ""
              ) -> RunEndpoints:
    steps = [s for s, _ in curve]
    complete = all(s in steps for s in range(EVERY, horizon + 1, EVERY))
    final = dict(curve).get(horizon, math.nan)
    t, censored = relearn_time(curve, horizon=horizon)
    tail = [v for s, v in curve if s >= horizon - 4 * EVERY]
    before = dict(curve).get(horizon - 2 * EVERY, math.nan)
    rising = final - before >= RISING - 1e-12  # may be re-learning: censoring would hide it
    harm, fall = harm_class(curve) if complete else ("missing", None)
    return RunEndpoints(
        warm, arm, seed, complete, steps, [v for _, v in curve], final, outcome(final), final >= KEPT_AT, t,
        censored, complete and all(v < BAND[0] for v in tail) and not rising, niche_auc(curve, horizon), harm, fall,
        harm_class(curve, held_from=KEPT_AT)[0] if complete else "missing", evaluated)


def _niche_of(eval_json: Path, niche: str) -> tuple[float, str]:
    """The niche's accuracy in an ``eval.json``, and how it was evaluated (seed, problems, samples)."""
    ev = json.loads(eval_json.read_text())
    cfg = ev.get("config", {})
    how = f"seed={cfg.get('seed')} limit={cfg.get('limit')} n={cfg.get('n')} data={cfg.get('data')}"
    return float(ev.get("by", {}).get("groups", {}).get(niche, {}).get("pass@1", math.nan)), how


def read_runs(warm: str, out: Path, horizon: int = HORIZON) -> list[RunEndpoints]:
    """Every run of experiment ``out`` with at least one evaluated checkpoint (partial ones included)."""
    from experiments.collapse_testbed.results import experiment_task

    niche = experiment_task(out).headline_niche
    runs = []
    for d in sorted((out / "runs").glob("*/seed_*"), key=lambda p: (p.parent.name, int(p.name.split("_")[1]))):
        seed = int(d.name.split("_")[1])
        evals = {int(e.parent.name.split("_")[1]): _niche_of(e, niche) for e in d.glob("ckpt_eval/step_*/eval.json")}
        if not evals:
            continue
        warm_eval = out / "warm_eval" / f"seed_{seed}" / "eval.json"
        if warm_eval.is_file():
            evals[0] = _niche_of(warm_eval, niche)
        how = sorted({h for _, h in evals.values()})
        if len(how) > 1:
            raise ValueError(f"{d}: checkpoints evaluated in different ways ({how}); not one niche curve")
        curve = sorted((s, v) for s, (v, _) in evals.items() if s <= horizon)
        runs.append(endpoints(warm, d.parent.name, seed, curve, horizon, how[0]))
    return runs


# ------------------------------------------------------------------------------------------- tests
def sign_flip_p(diffs: Sequence[float]) -> float:
    """Exact two-sided sign-flip p of per-seed differences (``meshrl.stats.paired_permutation_test``: all
    ``2^n`` sign vectors, ``p = #{|sum s d| >= |sum d|} / 2^n``; Fisher 1935, Good "Permutation Tests" §3.1)."""
    from meshrl.stats import paired_permutation_test

    if not diffs:
        return math.nan
    if len(diffs) > 24:
        raise ValueError(f"{len(diffs)} pairs: more than the exact test's 24")
    return paired_permutation_test(list(diffs), [0.0] * len(diffs), exact_max_problems=24)


def mcnemar_exact(arm_only: int, base_only: int) -> float:
    """McNemar's exact test (McNemar 1947; Agresti, "Categorical Data Analysis", 3rd ed., §11.1.4) on the
    discordant pairs: ``n = b + c``, ``p = min(1, 2 * sum_{k <= min(b, c)} C(n, k) / 2^n)``; 1 when ``n = 0``."""
    n = arm_only + base_only
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(arm_only, base_only) + 1)) / 2**n)


@dataclass(frozen=True)
class Pair:
    warm: str
    seed: int
    arm: RunEndpoints
    base: RunEndpoints


def pairs(runs: list[RunEndpoints], arm: str, base: str, warms: Sequence[str]) -> list[Pair]:
    """Complete runs of ``arm`` and ``base`` with the same warm start and seed (same problems, same evaluation)."""
    by = {(r.warm, r.arm, r.seed): r for r in runs if r.complete}
    ps = [Pair(w, s, by[w, arm, s], by[w, base, s]) for (w, a, s) in sorted(by)
          if a == arm and w in warms and (w, base, s) in by]
    for p in ps:
        if p.arm.evaluated != p.base.evaluated:
            raise ValueError(f"{p.warm} seed {p.seed}: {arm} and {base} were evaluated differently "
                             f"({p.arm.evaluated} vs {p.base.evaluated}); they cannot be paired")
    return ps


ENDPOINTS = ("relearn", "final", "auc", "kept")


def compare(ps: list[Pair], endpoint: str) -> dict[str, Any]:
    """One pre-registered test of ``endpoint`` over the seed pairs ``ps`` (difference = arm - GRPO)."""
    from meshrl.stats import fisher_exact

    if endpoint == "kept":  # borderline runs count neither way
        a_only = sum(p.arm.at_horizon == "kept" and p.base.at_horizon == "lost" for p in ps)
        b_only = sum(p.arm.at_horizon == "lost" and p.base.at_horizon == "kept" for p in ps)
        counts = [[sum(p.arm.at_horizon == o for p in ps) for o in ("kept", "lost")],
                  [sum(p.base.at_horizon == o for p in ps) for o in ("kept", "lost")]]
        return {"n": len(ps), "test": "McNemar exact", "arm_only": a_only, "base_only": b_only,
                "p": mcnemar_exact(a_only, b_only) if ps else math.nan,
                "fisher_p": fisher_exact(counts).p_value if ps else math.nan, "counts": counts}
    diffs = [getattr(p.arm, endpoint) - getattr(p.base, endpoint) for p in ps]
    diffs = [d for d in diffs if d == d]  # AUC needs the step-0 evaluation
    mean = sum(diffs) / len(diffs) if diffs else math.nan
    return {"n": len(diffs), "test": "sign-flip exact", "mean_diff": mean, "p": sign_flip_p(diffs),
            "min_diff": min(diffs, default=math.nan), "max_diff": max(diffs, default=math.nan),
            "zeros": sum(d == 0 for d in diffs)}  # no sign flip moves a 0: it bounds the reachable p


def comparisons(runs: list[RunEndpoints], warms: Sequence[str]) -> list[dict[str, Any]]:
    """The pre-registered families, Holm-corrected within each: ``primary`` = CP-only vs GRPO pooled over the
    warm starts (4 tests); ``secondary`` = the same per warm start, and the secondary arms vs GRPO (pooled and
    per warm start)."""
    rows = []
    for arm in (PRIMARY[0], *SECONDARY_ARMS):
        for scope in ("pooled", *warms):
            ps = pairs(runs, arm, PRIMARY[1], warms if scope == "pooled" else [scope])
            family = "primary" if arm == PRIMARY[0] and scope == "pooled" else "secondary"
            if not ps and family == "secondary":
                continue
            rows += [{"family": family, "arm": arm, "scope": scope, "endpoint": e, **compare(ps, e)}
                     for e in ENDPOINTS]
    return holm_within_families(rows)


def holm_within_families(rows: list[dict[str, Any]], *, planned_size: bool = False) -> list[dict[str, Any]]:
    """Set ``p_holm`` on every row with a p, Holm-corrected within its ``family``. A row without a p (no pairs yet)
    stays out of the correction, or with ``planned_size`` counts as p = 1, so that a family is as large as
    pre-registered however much of the grid is in, and a partial grid cannot pass a test the full one would not."""
    from meshrl.stats import holm_correction

    for family in dict.fromkeys(r["family"] for r in rows):
        idx = [i for i, r in enumerate(rows) if r["family"] == family and (planned_size or r["p"] == r["p"])]
        if idx:
            adjusted, _ = holm_correction([rows[i]["p"] if rows[i]["p"] == rows[i]["p"] else 1.0 for i in idx])
            for i, p in zip(idx, adjusted, strict=True):
                if rows[i]["p"] == rows[i]["p"]:
                    rows[i]["p_holm"] = float(p)
    return rows


# ------------------------------------------------------------------------------------------- tables
def arm_summary(runs: list[RunEndpoints]) -> list[dict[str, Any]]:
    """Per (warm start, arm): runs found and complete, outcomes at the horizon, re-learning, area, harm."""
    from meshrl.analysis._common import finite_stats

    rows = []
    for warm, arm in sorted({(r.warm, r.arm) for r in runs}):
        rs = [r for r in runs if r.warm == warm and r.arm == arm]
        done = [r for r in rs if r.complete]
        count = {k: sum(getattr(r, f) == k for r in done)
                 for f, ks in (("at_horizon", ("kept", "borderline", "lost")), ("harm", ("harm", "dip", "none")))
                 for k in ks}
        t = sorted(r.relearn for r in done if not r.censored)
        final, final_sd, _ = finite_stats([r.final for r in done])
        auc, auc_sd, _ = finite_stats([r.auc for r in done])
        rows.append({"warm": warm, "arm": arm, "runs": len(rs), "complete": len(done), **count,
                     "nominal_kept": sum(r.nominal_kept for r in done),
                     "persistent_loss": sum(r.persistent_loss for r in done), "relearned": len(t),
                     "relearn_steps": [r.relearn if not r.censored else None for r in done],
                     "final": final, "final_sd": final_sd, "auc": auc, "auc_sd": auc_sd,
                     "harm_after_hold": sum(r.harm_after_hold == "harm" for r in done)})
    return rows


def decisions(runs: list[RunEndpoints]) -> list[dict[str, Any]]:
    """Per arm over every warm start (the decision rules of H1 and H2): persistent losses and re-learned runs
    among the complete ones, each with a 95% Wilson interval."""
    from meshrl.stats import wilson_interval

    rows = []
    for arm in sorted({r.arm for r in runs}):
        done = [r for r in runs if r.arm == arm and r.complete]
        row: dict[str, Any] = {"arm": arm, "complete": len(done)}
        for key, k in (("persistent_loss", sum(r.persistent_loss for r in done)),
                       ("relearned", sum(not r.censored for r in done))):
            row[key] = k
            row[f"{key}_ci"] = tuple(wilson_interval(k, len(done))) if done else (math.nan, math.nan)
        rows.append(row)
    return rows


def _f(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "–"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def markdown(runs: list[RunEndpoints], rows: list[dict[str, Any]]) -> str:
    """The three tables: per arm, per comparison, per run."""
    out = [f"# Persistence: {HORIZON} steps (preregistration.md)", "",
           f"Kept at {HORIZON}: decade > {BAND[1]}; lost: < {BAND[0]}; borderline in between (counted neither "
           f"way). Nominal: >= {KEPT_AT}. Re-learned: decade >= {KEPT_AT} after the early dip (censored at "
           f"{HORIZON}). Persistent loss: < {BAND[0]} at every checkpoint from step {HORIZON - 4 * EVERY}, not rising "
           f"by {RISING} over the last {2 * EVERY} steps.", "",
           "| warm | arm | runs (complete) | kept / borderline / lost | nominal >= 0.5 | persistent loss | "
           "re-learned (steps; - = censored) | decade at horizon | area | harm / dip / none | harm after hold |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in arm_summary(runs):
        steps = ", ".join("-" if t is None else str(t) for t in a["relearn_steps"])
        out.append(f"| {a['warm']} | {a['arm']} | {a['runs']} ({a['complete']}) | {a['kept']} / {a['borderline']} / "
                   f"{a['lost']} | {a['nominal_kept']} | {a['persistent_loss']} | {a['relearned']} ({steps}) | "
                   f"{_f(a['final'])} ± {_f(a['final_sd'], 2)} | {_f(a['auc'])} ± {_f(a['auc_sd'], 2)} | "
                   f"{a['harm']} / {a['dip']} / {a['none']} | {a['harm_after_hold']} |")
    out += ["", "Over every warm start (95% Wilson intervals):", "",
            "| arm | complete runs | persistent loss | re-learned by the horizon |", "|---|---|---|---|"]
    for d in decisions(runs):
        lo, hi = d["persistent_loss_ci"]
        rlo, rhi = d["relearned_ci"]
        out.append(f"| {d['arm']} | {d['complete']} | {d['persistent_loss']} [{_f(lo, 2)}, {_f(hi, 2)}] | "
                   f"{d['relearned']} [{_f(rlo, 2)}, {_f(rhi, 2)}] |")
    out += ["", "Comparisons (arm − GRPO; seeds paired within a warm start; Holm within each family):", "",
            "| family | arm | warm | endpoint | pairs | test | difference or discordant (arm / GRPO) | p | Holm p |"
            " Fisher p |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        what = (f"{r['arm_only']} / {r['base_only']}" if r["endpoint"] == "kept" else _f(r["mean_diff"]))
        out.append(f"| {r['family']} | {r['arm']} | {r['scope']} | {r['endpoint']} | {r['n']} | {r['test']} | {what} "
                   f"| {_f(r['p'])} | {_f(r.get('p_holm'))} | {_f(r.get('fisher_p'))} |")
    out += ["", "Per run:", "", "| warm | arm | seed | complete | decade at horizon | outcome | re-learned at | area "
            "| class | fall step | curve (step: decade) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        curve = " ".join(f"{s}:{v:.2f}" for s, v in zip(r.steps, r.niche, strict=True))
        out.append(f"| {r.warm} | {r.arm} | {r.seed} | {'yes' if r.complete else 'no'} | {_f(r.final)} | "
                   f"{r.at_horizon} | {'>' if r.censored else ''}{r.relearn} | {_f(r.auc)} | {r.harm} | "
                   f"{_f(r.fall_step)} | {curve} |")
    return "\n".join(out) + "\n"


def analyse(dirs: dict[str, Path], horizon: int = HORIZON) -> tuple[list[RunEndpoints], list[dict[str, Any]]]:
    runs = [r for warm, out in dirs.items() for r in read_runs(warm, out, horizon)]
    return runs, comparisons(runs, list(dirs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.collapse_testbed.persistence",
                                description="The persistence experiment's endpoints and seed-level tests.")
    p.add_argument("dirs", nargs="+", metavar="WARM=DIR", help="an experiment directory per warm start")
    p.add_argument("--out", type=Path, default=Path("persistence.md"), help="the markdown tables")
    p.add_argument("--json", type=Path, default=None, help="also every run's endpoints and every test, as JSON")
    args = p.parse_args(argv)
    try:
        dirs = named_dirs(args.dirs)
    except ValueError as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    runs, rows = analyse(dirs)
    args.out.write_text(markdown(runs, rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs], "tests": rows}, indent=1))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
