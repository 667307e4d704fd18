"""The staleness experiment's endpoints and seed-level tests, as pre-registered in preregistration_staleness.md.

Per run: the persistence experiment's endpoints (``persistence.py``: the niche curve from the checkpoint evaluations,
time to re-learn T censored at 160, the niche at 160, the area, kept / borderline / lost) and, from the lagged runs'
``metrics.jsonl``, what they trained on: the staleness (``lag/staleness_mean``) and the correction's weights
(``rollout_corr/ess``, ``rollout_corr/frac_truncated``, ``m2po/*``), averaged over the run's steps.

Comparisons (seeds paired by number, all from warm start W2; difference = arm − reference):

* **primary** (Holm over 3, on T): ``grpo_k8_none − grpo`` (S1: staleness), ``grpo_k8_tis − grpo_k8_none`` and
  ``grpo_k8_m2po − grpo_k8_none`` (S2: correction);
* **secondary** (Holm over all of it): the same three at k = 1, 2, 4 on T; the niche at 160, the area and kept
  (McNemar) for every comparison above; and ``grpo_k8_tis − grpo`` on all four endpoints.

The k = 0 check: the ``grpo`` arm must reproduce the persistence experiment's W2 GRPO curves seed for seed (the lag
code is not used at k = 0); :func:`reproduces` compares them when that experiment's directory is given.

One CPU per pair (*post hoc*, results.md): a run repeats bit for bit only on a like CPU, so a seed whose packed
k = 0 run was made on another (or an unrecorded) CPU gets a k = 0 run remade on the CPU of its k = 1, 2, 4 runs, in a
directory of its own (``--remade``); those arms are paired with it (:data:`REMADE` in the tables), the k = 8 arms
with the packed one they were made beside.

``python -m experiments.collapse_testbed.staleness runs/staleness [--reference runs/persist_W2] [--remade DIR]
--out staleness.md``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments.collapse_testbed import persistence as P
from meshrl.cpu import machine_label
from meshrl.jsonl import read_jsonl

WARM = "W2"
K_PRIMARY = 8
K_SECONDARY = (1, 2, 4)
PLANNED_PAIRS = {K_PRIMARY: 8, **{k: 5 for k in K_SECONDARY}}  # seeds per lag (preregistration_staleness.md)
DIVERGENCE_FINDINGS = ("stale_rollouts", "ratio_tail")  # the doctor's findings that say a lagged run diverges
NONFINITE_KEYS = ("loss/total", "grad/norm")
LAG_METRICS = ("lag/staleness_mean", "rollout_corr/ess", "rollout_corr/frac_truncated", "rollout_corr/weight_max",
               "m2po/masked_frac")
REMADE = "grpo_remade"  # a seed's k = 0 run remade on the CPU of its k = 1, 2, 4 runs (module docstring)


def lagged(k: int, correction: str) -> str:
    return f"grpo_k{k}_{correction}"


def planned() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """``(family, arm, reference, endpoints)`` for every pre-registered comparison, in the tables' order."""
    rows: list[tuple[str, str, str, tuple[str, ...]]] = []
    k8 = [(lagged(K_PRIMARY, "none"), "grpo"), (lagged(K_PRIMARY, "tis"), lagged(K_PRIMARY, "none")),
          (lagged(K_PRIMARY, "m2po"), lagged(K_PRIMARY, "none"))]
    rows += [("primary", arm, ref, ("relearn",)) for arm, ref in k8]
    rows += [("secondary", arm, ref, ("final", "auc", "kept")) for arm, ref in k8]
    for k in K_SECONDARY:
        for arm, ref in ((lagged(k, "none"), "grpo"), (lagged(k, "tis"), lagged(k, "none")),
                         (lagged(k, "m2po"), lagged(k, "none"))):
            rows.append(("secondary", arm, ref, P.ENDPOINTS))
    rows.append(("secondary", lagged(K_PRIMARY, "tis"), "grpo", P.ENDPOINTS))
    return rows


def secondary_lag(arm: str) -> bool:
    return any(arm.startswith(f"grpo_k{k}_") for k in K_SECONDARY)


def with_remade_k0(runs: list[P.RunEndpoints]) -> list[P.RunEndpoints]:
    """``runs`` with each seed's ``grpo`` run replaced by its :data:`REMADE` run where there is one: the k = 0
    reference of the k = 1, 2, 4 arms, made on their CPU."""
    remade = {r.seed: replace(r, arm="grpo") for r in runs if r.arm == REMADE}
    return [r for r in runs if r.arm != REMADE and not (r.arm == "grpo" and r.seed in remade)] + list(remade.values())


def planned_pairs(runs: list[P.RunEndpoints]
                  ) -> Iterator[tuple[str, str, str, tuple[str, ...], list[P.Pair], bool]]:
    """Per planned comparison, ``(family, arm, reference, endpoints, pairs, remade)``: its complete seed pairs, the
    k = 1, 2, 4 arms paired with a seed's :data:`REMADE` k = 0 run where it has one (:func:`with_remade_k0`;
    ``remade`` says whether this comparison's k = 0 side may be such a run)."""
    same_cpu = with_remade_k0(runs)
    for family, arm, ref, endpoints in planned():
        remade = ref == "grpo" and secondary_lag(arm)
        yield family, arm, ref, endpoints, P.pairs(same_cpu if remade else runs, arm, ref, [WARM]), remade


def comparisons(runs: list[P.RunEndpoints]) -> list[dict[str, Any]]:
    """Every planned comparison over the complete seed pairs found (:func:`planned_pairs`), Holm-corrected within
    each family over all its pre-registered comparisons (one not testable yet counts as p = 1, and is listed with
    n = 0)."""
    rows = [{"family": family, "arm": arm, "reference": ref, "endpoint": e, **P.compare(ps, e)}
            for family, arm, ref, endpoints, ps, _ in planned_pairs(runs) for e in endpoints]
    return P.holm_within_families(rows, planned_size=True)


def lag_figures(out: Path, complete: set[tuple[str, int]] | None = None) -> dict[str, dict[str, float]]:
    """Per arm: the mean over its runs of each run's mean of :data:`LAG_METRICS` (keys a run never logged are
    left out; a run counts once whatever its length); only the ``complete`` runs (arm, seed) when given, so that a
    run still training does not move the table."""
    per_arm: dict[str, dict[str, list[float]]] = {}
    for d in sorted((out / "runs").glob("*/seed_*")):
        path = d / "metrics.jsonl"
        if not path.is_file() or (complete is not None and (d.parent.name, int(d.name[5:])) not in complete):
            continue
        rows = read_jsonl(path)
        for key in LAG_METRICS:
            vals = [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and r[key] == r[key]]
            if vals:
                per_arm.setdefault(d.parent.name, {}).setdefault(key, []).append(sum(vals) / len(vals))
    return {arm: {k: sum(v) / len(v) for k, v in keys.items()} for arm, keys in per_arm.items()}


def overall_at_horizon(out: Path, horizon: int = P.HORIZON) -> dict[tuple[str, int], float]:
    """Per run (arm, seed): held-out accuracy over every problem type at the horizon (the divergence check: a run
    that lost every type measures instability, not strategy retention)."""
    found = {}
    for e in sorted((out / "runs").glob(f"*/seed_*/ckpt_eval/step_{horizon}/eval.json")):
        run = e.parents[2]
        found[run.parent.name, int(run.name[5:])] = float(json.loads(e.read_text())["overall"]["pass@1"])
    return found


def run_machines(out: Path, arm: str | None = "grpo") -> dict[Any, str]:
    """The CPU each finished run was made on (:func:`machine_label`), where its ``done.json`` records it (runs made
    before runs recorded their machine are left out): by seed for one ``arm``, by ``(arm, seed)`` for ``None``."""
    found: dict[Any, str] = {}
    for done in sorted((out / "runs").glob(f"{arm or '*'}/seed_*/done.json")):
        machine = json.loads(done.read_text()).get("machine")
        if machine:
            seed = int(done.parent.name[5:])
            found[seed if arm else (done.parent.parent.name, seed)] = machine_label(machine)
    return found


def divergent(out: Path, complete: set[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """The lagged runs that diverge as preregistration_staleness.md defines it ("What would change the
    conclusion"): a run the trainer aborted, a non-finite step (:data:`NONFINITE_KEYS`), or one of
    :data:`DIVERGENCE_FINDINGS` active at most (more than half) of the run's health checks; the reason per
    ``(arm, seed)``."""
    from experiments.collapse_testbed.experiment import aborted

    found = {}
    for d in sorted((out / "runs").glob("*/seed_*")):
        if d.parent.name != "grpo" and aborted(d):
            found[d.parent.name, int(d.name[5:])] = f"aborted by the trainer: {aborted(d)}"
    for arm, seed in sorted(complete):
        if arm == "grpo":
            continue
        d = out / "runs" / arm / f"seed_{seed}"
        reasons = []
        metrics = read_jsonl(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
        bad = [r["step"] for r in metrics if any(k in r and not math.isfinite(float(r[k])) for k in NONFINITE_KEYS)]
        if bad:
            reasons.append(f"non-finite at {len(bad)} step(s), first {bad[0]}")
        share = finding_share(d)
        reasons += [f"{name} at {share[name][0]} of {share[name][1]} health checks" for name in DIVERGENCE_FINDINGS
                    if at_most_checks(share, name)]
        if reasons:
            found[arm, seed] = "; ".join(reasons)
    return found


def at_most_checks(share: dict[str, tuple[int, int]], name: str) -> bool:
    """Whether finding ``name`` was active at more than half of the health checks (:func:`finding_share`)."""
    n, total = share.get(name, (0, 0))
    return n * 2 > total


def finding_share(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Per health finding: at how many of the run's health checks it was active, and how many checks there were."""
    path = run_dir / "events.jsonl"
    checks = [e for e in (read_jsonl(path) if path.is_file() else []) if e.get("event") == "health_check"]
    names = {f for e in checks for f in e.get("findings", [])}
    return {f: (sum(f in e.get("findings", []) for e in checks), len(checks)) for f in sorted(names)}


def reproduces(runs: list[P.RunEndpoints], reference: list[P.RunEndpoints],
               machines: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """The k = 0 check: per seed present in both, whether this experiment's ``grpo`` niche curve equals the
    reference experiment's ``grpo`` curve (persistence, W2) exactly, the first step where they differ, and the CPU
    the seed was made on where recorded (``machines``, :func:`run_machines`): a run repeats bit for bit only on a
    like CPU, float rounding following its vector instructions."""
    machines = machines or {}
    mine = {r.seed: r for r in runs if r.arm == "grpo"}
    ref = {r.seed: r for r in reference if r.arm == "grpo"}
    out = []
    for seed in sorted(set(mine) & set(ref)):
        a, b = dict(zip(mine[seed].steps, mine[seed].niche, strict=True)), \
            dict(zip(ref[seed].steps, ref[seed].niche, strict=True))
        common = sorted(set(a) & set(b))
        first = next((s for s in common if a[s] != b[s]), None)
        out.append({"seed": seed, "checkpoints": len(common), "identical": first is None, "first_difference": first,
                    **({"machine": machines[seed]} if seed in machines else {})})
    return out


def partial_status(rows: list[dict[str, Any]]) -> str:
    """What of the grid is in, said first: the pairs per pre-registered lag against their number."""
    parts = []
    for k, want in PLANNED_PAIRS.items():
        n = max((r["n"] for r in rows if r["arm"] == lagged(k, "none") and r["reference"] == "grpo"), default=0)
        parts.append(f"k = {k}: {n} of {want} pairs" if n else f"k = {k}: no complete pair")
    done = all(max((r["n"] for r in rows if r["arm"] == lagged(k, "none") and r["reference"] == "grpo"), default=0)
               >= want for k, want in PLANNED_PAIRS.items())
    return ("Complete: " if done else "**Partial grid** (a comparison is decided only with all its pre-registered "
                                      "pairs): ") + "; ".join(parts) + "."


def decision(rows: list[dict[str, Any]]) -> str:
    """The grid's state, then the pre-registered decision rules in one paragraph; before the 8 pairs of S1 its
    figures are reported as they stand, not as the verdict."""
    return partial_status(rows) + " " + _s1(rows)


def _s1(rows: list[dict[str, Any]]) -> str:
    prim = {r["arm"]: r for r in rows if r["family"] == "primary"}
    s1 = prim.get(lagged(K_PRIMARY, "none"))
    if s1 is None or s1["n"] == 0:
        return "S1 not testable yet: no complete seed pair of grpo_k8_none and grpo."
    holm, n, want = s1.get("p_holm", math.nan), s1["n"], PLANNED_PAIRS[K_PRIMARY]
    spread = f", differences {P._f(s1['min_diff'])} to {P._f(s1['max_diff'])}" if "min_diff" in s1 else ""
    if n < want:
        zeros = s1.get("zeros", 0)
        # the smallest two-sided sign-flip p over m non-zero differences is 2 / 2^m; Holm over the 3 primary tests
        floor = min(1.0, len(prim) * 2 / 2 ** (n - zeros))
        at_full = min(1.0, len(prim) * 2 / 2 ** (want - zeros))
        bound = (f"; with {zeros} difference(s) of 0, which no sign flip moves, the smallest Holm p reachable at "
                 f"{want} pairs is {P._f(at_full)}" + (", so S1 cannot pass" if at_full > 0.05 else "")
                 if zeros else "")
        return (f"S1 so far at {n} of {want} pairs: mean difference in T {P._f(s1['mean_diff'])} steps{spread}, "
                f"Holm p = {P._f(holm)} (at {n} pairs the smallest reachable Holm p is {P._f(floor)}{bound}).")
    if holm <= 0.05:
        way = "later" if s1["mean_diff"] > 0 else "sooner"
        text = (f"S1 passes (Holm p = {holm:.3g}, {n} pairs): an 8-step lag re-learns the niche {way} "
                f"(mean difference in T {s1['mean_diff']:+.1f} steps{spread}).")
        corrections = (lagged(K_PRIMARY, "tis"), lagged(K_PRIMARY, "m2po"))
        undo = [arm for arm in corrections
                if prim.get(arm, {}).get("n", 0) >= want and prim[arm].get("p_holm", math.nan) <= 0.05
                and math.copysign(1, prim[arm]["mean_diff"]) != math.copysign(1, s1["mean_diff"])]
        open_ = [f"{arm} at {prim.get(arm, {}).get('n', 0)} of {want} pairs" for arm in corrections
                 if prim.get(arm, {}).get("n", 0) < want]
        if undo:
            return text + f" Correction undoes it: {', '.join(undo)}."
        return text + (f" Whether a correction undoes it is not decided yet ({'; '.join(open_)})." if open_
                       else " No correction undoes it.")
    return (f"No effect of an 8-step lag detected at {n} pairs (Holm p = {P._f(holm)}; mean difference in T "
            f"{P._f(s1['mean_diff'])} steps{spread}); the S2 rows report what the correction changed, not an undoing.")


def without_divergent(runs: list[P.RunEndpoints], gone: dict[tuple[str, int], str]) -> str:
    """The post hoc repeat of S1 without the diverging runs (preregistration_staleness.md), one paragraph."""
    if not gone:
        return "No lagged run diverges (non-finite steps, or the doctor's stale_rollouts or ratio_tail at most checks)."
    named = "; ".join(f"{a} seed {s} ({why})" for (a, s), why in sorted(gone.items()))
    kept = [r for r in runs if (r.arm, r.seed) not in gone]
    ps = P.pairs(kept, lagged(K_PRIMARY, "none"), "grpo", [WARM])
    res = P.compare(ps, "relearn")
    repeat = ("no pair is left: S1 cannot be repeated without them, so at k = 8 the comparison measures instability, "
              "not strategy retention" if not ps else
              f"S1 without them: {res['n']} pairs, mean difference in T {P._f(res['mean_diff'])} steps, p = "
              f"{P._f(res['p'])}")
    by_definition = any("stale_rollouts" in why for (a, _), why in gone.items() if a.endswith("_none"))
    note = (" (stale_rollouts is raised on every uncorrected lagged run by its definition, as it says the batches "
            "are trained uncorrected: under this rule no `none` run can be kept; on a TIS run it judges the weights, "
            "and ratio_tail and non-finite steps speak to instability on any run)" if by_definition else "")
    return f"Diverging lagged runs (named as pre-registered): {named}. *Post hoc*, {repeat}{note}."


def compared_pairs(runs: list[P.RunEndpoints]) -> set[tuple[tuple[str, int], tuple[str, int]]]:
    """The runs ``((arm, seed), (reference arm, seed))`` of every complete pair the comparisons use, the reference
    named :data:`REMADE` where :func:`comparisons` took a seed's remade k = 0 run."""
    remade_seeds = {r.seed for r in runs if r.arm == REMADE}
    return {((arm, p.seed), (REMADE if remade and p.seed in remade_seeds else ref, p.seed))
            for _, arm, ref, _, ps, remade in planned_pairs(runs) for p in ps}


def machine_note(machines: dict[tuple[str, int], str], runs: list[P.RunEndpoints]) -> str:
    """Whether each pair the comparisons use was made on one CPU, as far as its two runs recorded it."""
    mixed, unknown = set(), set()
    for a, b in compared_pairs(runs):
        if a not in machines or b not in machines:
            unknown.add(a[1])
        elif machines[a] != machines[b]:
            mixed.add(a[1])
    text = ("Pairs made on two CPUs: " + ", ".join(f"seed {s}" for s in sorted(mixed)) + "." if mixed else
            "Every compared pair whose two runs record their CPU was made on one CPU.")
    return text + (f" {_seeds(sorted(unknown))} pairs with a run that records no CPU (made before runs recorded it)."
                   if unknown else "")


def _seeds(seeds: list[int]) -> str:
    return _seed_list(seeds).capitalize() + (" has" if len(seeds) == 1 else " have")


def remade_note(again: list[dict[str, Any]], runs: list[P.RunEndpoints]) -> str:
    """What the :data:`REMADE` k = 0 runs are, and how each compares with its seed's packed k = 0 run."""
    t = {(r.arm, r.seed): r for r in runs}

    def relearned(r: P.RunEndpoints | None) -> str:
        return "-" if r is None or not r.complete else ("not by 160" if r.censored else f"at {r.relearn}")

    per_seed = "; ".join(
        f"seed {c['seed']} " + (f"niche curve identical at {c['checkpoints']} checkpoints" if c["identical"]
                                else f"niche curves parted at step {c['first_difference']}")
        + f", re-learned {relearned(t.get((REMADE, c['seed'])))} (packed {relearned(t.get(('grpo', c['seed'])))})"
        for c in again)
    cpus = sorted({c.get("machine", "not recorded") for c in again})
    return (f"k = 0 remade for the k = 1, 2, 4 arms ({REMADE}; *post hoc*: one CPU per pair, as a run repeats bit "
            f"for bit only on a like CPU): made on {', '.join(cpus)}; against the packed k = 0 run: {per_seed}. "
            "The k = 8 arms keep the packed k = 0 run they were made beside.")


def k0_stop_text(check: list[dict[str, Any]], shown: list[int] | None = None, against: list[int] | None = None) -> str:
    """What the pre-registered stop rule says when the k = 0 check fails, and what the recorded CPUs say for and
    against putting the difference down to the CPU (the experiment went on: *post hoc*); ``shown`` and
    ``against``: the seeds whose k = 0 run, made again on another CPU or on the packed run's own, repeats the
    reference run (:func:`cpu_check_result`)."""
    def cpus(cs: list[dict[str, Any]]) -> str:
        known = sorted({c["machine"] for c in cs if "machine" in c})
        unknown = sum("machine" not in c for c in cs)
        without = f"{unknown} seed{'' if unknown == 1 else 's'} without a record"
        return (", ".join(known) if known else "") + (("; " if known else "") + without if unknown else "")
    differ = [c for c in check if not c["identical"]]
    same = [c for c in check if c["identical"]]
    return ("The pre-registered rule stops the experiment here until the difference is found; it went on "
            "(*post hoc*), the difference put down to the CPU, each seed's runs made on one machine. Recorded CPUs: "
            f"the seeds that differ, {cpus(differ)}; the identical ones, {cpus(same) if same else 'none'}; the "
            "reference runs, none. " + _cause(differ, shown or [], against or []))


def _cause(differ: list[dict[str, Any]], shown: list[int], against: list[int]) -> str:
    seeds = {c["seed"] for c in differ}
    shown, against = sorted(set(shown) & seeds), sorted(set(against) & seeds)
    rest = sorted(seeds - set(shown) - set(against))
    one = len(shown) == 1
    parts = ([f"The CPU is shown to be the cause for {_seed_list(shown)} (made again on another CPU, "
              f"{'it repeats the reference run' if one else 'they repeat the reference runs'}: the CPU check below)"]
             if shown else [])
    if against:
        parts.append(f"not explained by the CPU as recorded for {_seed_list(against)} (made again on the CPU its "
                     "packed run records, it repeats the reference run: the CPU check below)")
    if not parts:
        return "The CPU is a likely cause, not a shown one."
    if rest:
        parts.append(f"a likely cause for {_seed_list(rest)}")
    text = "; ".join(parts) + "."
    return text[0].upper() + text[1:]


def _seed_list(seeds: list[int]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


#: metric keys that measure the machine's speed, not the run: left out when two runs' records are compared
WALL_CLOCK = ("time/", "throughput/", "mem/")


def metrics_agree(a: Path, b: Path) -> tuple[int, int | None]:
    """(steps both runs' ``metrics.jsonl`` hold, the first step whose records differ outside :data:`WALL_CLOCK`, or
    ``None``; a step only one run holds differs): the training half of the comparison, where :func:`reproduces`
    compares the niche curves."""
    def records(d: Path) -> dict[int, dict[str, Any]]:
        path = d / "metrics.jsonl"
        rows = read_jsonl(path) if path.is_file() else []
        return {int(r.get("step", i + 1)): {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)}
                for i, r in enumerate(rows)}

    ra, rb = records(a), records(b)
    differ = sorted(step for step in set(ra) | set(rb) if ra.get(step) != rb.get(step))
    return len(set(ra) & set(rb)), (differ[0] if differ else None)


def cpu_check_result(check_dir: Path, reference_dir: Path, runs: list[P.RunEndpoints], packed_cpu: dict[int, str],
                     reference: list[P.RunEndpoints]) -> tuple[str, list[int], list[int]]:
    """GRPO at k = 0 made again on one more CPU (*post hoc*; ``check_dir``), against the persistence experiment's W2
    run (``reference``, in ``reference_dir``) and this experiment's packed run (``runs``; its CPU ``packed_cpu``, by
    seed: :func:`run_machines`) of each seed.
    Returns :func:`cpu_check_note`'s text, the seeds it shows the CPU to be the cause for (the run made again
    repeats the W2 run, every logged training metric at every step and the niche curve at every checkpoint, both
    runs complete, on a CPU recorded as other than the packed run's) and the seeds where it speaks against the CPU
    (the same, made on the CPU the packed run records)."""
    made = [r for r in P.read_runs(WARM, check_dir) if r.arm == "grpo"]
    again = [r for r in made if r.complete]
    vs_reference = reproduces(again, [r for r in reference if r.complete], run_machines(check_dir))
    for c in vs_reference:
        c["steps"], c["metrics_first_difference"] = metrics_agree(
            check_dir / "runs" / "grpo" / f"seed_{c['seed']}", reference_dir / "runs" / "grpo" / f"seed_{c['seed']}")
        c["repeats"] = c["identical"] and c["metrics_first_difference"] is None and c["steps"] > 0
    vs_packed = reproduces(again, [r for r in runs if r.complete])
    repeats = [c for c in vs_reference if c["repeats"] and c["seed"] in packed_cpu and c.get("machine") is not None]
    shown = [c["seed"] for c in repeats if c["machine"] != packed_cpu[c["seed"]]]
    against = [c["seed"] for c in repeats if c["machine"] == packed_cpu[c["seed"]]]
    missing = sorted({r.seed for r in again} - {c["seed"] for c in vs_reference})
    text = cpu_check_note(vs_reference, vs_packed, packed_cpu, missing)
    unfinished = sorted(r.seed for r in made if not r.complete)
    if unfinished:
        text += f" Not finished, left out: {_seed_list(unfinished)}."
    return text, shown, against


def cpu_check_note(vs_reference: list[dict[str, Any]], vs_packed: list[dict[str, Any]],
                   packed_machines: dict[int, str], missing: list[int] | None = None) -> str:
    """The CPU check in words (:func:`cpu_check_result`): per seed, the run made again against the W2 run
    (``vs_reference``: :func:`reproduces` with ``steps``, ``metrics_first_difference`` and ``repeats`` from
    :func:`cpu_check_result`)
    and against the packed k = 0 run (``vs_packed``), with the CPU each was made on; ``missing``: seeds made again
    that have no finished W2 run to compare with."""
    if not vs_reference:
        return ("CPU check (*post hoc*): " + (f"{_seed_list(missing)} made again, with no finished W2 run to compare "
                                              "with." if missing else "no finished k = 0 run made again yet."))
    cpus = sorted({c.get("machine", "a CPU not recorded") for c in vs_reference})
    packed = {c["seed"]: c for c in vs_packed}

    def against_w2(c: dict[str, Any]) -> str:
        trained = (f"training metrics at {c['steps']} steps" if c["metrics_first_difference"] is None
                   else f"training metrics parted at step {c['metrics_first_difference']}")
        curve = (f"niche curve at {c['checkpoints']} checkpoints" if c["identical"]
                 else f"niche curves parted at step {c['first_difference']}")
        return f"{'identical to' if c['repeats'] else 'parted from'} the W2 run ({trained}; {curve})"

    def against_packed(seed: int) -> str:
        c = packed.get(seed)
        if c is None:
            return "no finished packed k = 0 run"
        what = (f"identical to the packed k = 0 run at {c['checkpoints']} checkpoints" if c["identical"]
                else f"parted from the packed k = 0 run at step {c['first_difference']}")
        return what + (f" (made on {packed_machines[seed]})" if seed in packed_machines else " (its CPU not recorded)")

    per_seed = "; ".join(
        f"seed {c['seed']}" + (f" (on {c.get('machine', 'a CPU not recorded')})" if len(cpus) > 1 else "")
        + f" {against_w2(c)}, {against_packed(c['seed'])}" for c in vs_reference)
    text = f"CPU check (*post hoc*): GRPO at k = 0 made again on {', '.join(cpus)}: {per_seed}."
    if missing:
        text += f" {_seed_list(missing).capitalize()} made again: no finished W2 run to compare with."
    return text + (" A run that repeats the reference on one machine and parts from it on another was parted by that "
                   "machine's rounding, not by the code or the settings, which repeat the reference on the first."
                   if any(c["repeats"] for c in vs_reference) else "")


def markdown(runs: list[P.RunEndpoints], rows: list[dict[str, Any]], lag: dict[str, dict[str, float]],
             check: list[dict[str, Any]] | None, overall: dict[tuple[str, int], float] | None = None,
             gone: dict[tuple[str, int], str] | None = None, machines: dict[tuple[str, int], str] | None = None,
             k0_tails: list[str] | None = None, again: list[dict[str, Any]] | None = None,
             cpu_check: str = "", shown: list[int] | None = None, against: list[int] | None = None) -> str:
    machines = machines or {}
    out = ["# Staleness and strategy collapse (preregistration_staleness.md)", "", decision(rows), "",
           without_divergent(runs, gone or {})
           + (f" (ratio_tail is also active at most checks of k = 0 runs, seeds {', '.join(map(str, k0_tails))}: "
              "the criterion is not specific to the lag.)" if k0_tails else ""), "", machine_note(machines, runs), ""]
    if again:
        out += [remade_note(again, runs), ""]
    if check is not None:
        same = sum(c["identical"] for c in check)
        differ = [c for c in check if not c["identical"]]
        out += [f"k = 0 check against the persistence experiment's W2 GRPO runs: {same} of {len(check)} seeds "
                "identical" + ("" if not differ else " (first differences: " + ", ".join(
                    f"seed {c['seed']} at step {c['first_difference']}"
                    + (f", made on {c['machine']}" if "machine" in c else "")
                    for c in differ) + ")") + "."
                + (" A run repeats bit for bit only on a like CPU (float rounding follows its vector "
                   "instructions); the reference runs' CPU is not recorded in their pack."
                   if any("machine" in c for c in differ) else "")
                + (" " + k0_stop_text(check, shown, against) if differ else ""), ""]
    if cpu_check:
        out += [cpu_check, ""]
    overall = overall or {}
    out += ["| arm | runs (complete) | kept / borderline / lost | persistent loss | re-learned (steps; - = censored) "
            "| decade at 160 | area | all types at 160 | " + " | ".join(LAG_METRICS) + " |",
            "|---" * (8 + len(LAG_METRICS)) + "|"]
    for a in P.arm_summary(runs):
        steps = ", ".join("-" if t is None else str(t) for t in a["relearn_steps"])
        figs = lag.get(a["arm"], {})
        acc = [overall[r.arm, r.seed] for r in runs if r.arm == a["arm"] and r.complete and (r.arm, r.seed) in overall]
        out.append(f"| {a['arm']} | {a['runs']} ({a['complete']}) | {a['kept']} / {a['borderline']} / {a['lost']} | "
                   f"{a['persistent_loss']} | {a['relearned']} ({steps}) | {P._f(a['final'])} ± "
                   f"{P._f(a['final_sd'], 2)} | {P._f(a['auc'])} ± {P._f(a['auc_sd'], 2)} | "
                   f"{P._f(sum(acc) / len(acc) if acc else None)} | "
                   + " | ".join(P._f(figs.get(k)) for k in LAG_METRICS) + " |")
    out += ["", "Comparisons (arm − reference; seeds paired; Holm within each family):", "",
            "| family | arm | reference | endpoint | pairs | test | difference or discordant | p | Holm p |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        what = ("not run" if not r["n"] else f"{r['arm_only']} / {r['base_only']}" if r["endpoint"] == "kept"
                else P._f(r.get("mean_diff")))
        out.append(f"| {r['family']} | {r['arm']} | {r['reference']} | {r['endpoint']} | {r['n']} | {r['test']} | "
                   f"{what} | {P._f(r['p'])} | {P._f(r.get('p_holm'))} |")
    out += ["", "Per run:", "", "| arm | seed | complete | decade at 160 | outcome | re-learned at | area | "
            "all types at 160 | CPU | curve |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        curve = " ".join(f"{s}:{v:.2f}" for s, v in zip(r.steps, r.niche, strict=True))
        out.append(f"| {r.arm} | {r.seed} | {'yes' if r.complete else 'no'} | {P._f(r.final)} | {r.at_horizon} | "
                   f"{'>' if r.censored else ''}{r.relearn} | {P._f(r.auc)} | {P._f(overall.get((r.arm, r.seed)))} | "
                   f"{machines.get((r.arm, r.seed), '-')} | {curve} |")
    return "\n".join(out) + "\n"


def analyse(out: Path, reference: Path | None = None, remade: Path | None = None,
            cpu_check: Path | None = None) -> str:
    runs = P.read_runs(WARM, out)
    reference_runs = P.read_runs(WARM, reference) if reference is not None else []
    packed_cpu = run_machines(out)
    check = reproduces(runs, reference_runs, packed_cpu) if reference is not None else None
    cpu_text, shown, against = "", [], []
    if cpu_check is not None and reference is not None:
        cpu_text, shown, against = cpu_check_result(cpu_check, reference, runs, packed_cpu, reference_runs)
    complete = {(r.arm, r.seed) for r in runs if r.complete}
    def ratio_tail(d: Path, seed: int) -> bool:
        return at_most_checks(finding_share(d / "runs" / "grpo" / f"seed_{seed}"), "ratio_tail")

    k0_tails = [str(seed) for arm, seed in sorted(complete) if arm == "grpo" and ratio_tail(out, seed)]
    lag, gone = lag_figures(out, complete), divergent(out, complete)
    machines, overall = run_machines(out, None), overall_at_horizon(out)
    again = None
    if remade is not None:
        remade_runs = [r for r in P.read_runs(WARM, remade) if r.arm == "grpo"]
        remade_cpu = run_machines(remade)
        again = reproduces(remade_runs, runs, remade_cpu)
        runs += [replace(r, arm=REMADE) for r in remade_runs]
        machines.update({(REMADE, seed): m for seed, m in remade_cpu.items()})
        overall.update({(REMADE, s): v for (a, s), v in overall_at_horizon(remade).items() if a == "grpo"})
        k0_tails += [f"{r.seed} ({REMADE})" for r in remade_runs if r.complete and ratio_tail(remade, r.seed)]
    return markdown(runs, comparisons(runs), lag, check, overall, gone, machines, k0_tails, again, cpu_text, shown,
                    against)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.collapse_testbed.staleness",
                                description="The staleness experiment's endpoints and seed-level tests.")
    p.add_argument("dir", type=Path, help="the staleness experiment's directory (--preset staleness --out DIR)")
    p.add_argument("--reference", type=Path, default=None,
                   help="the persistence experiment's W2 directory, for the k = 0 check")
    p.add_argument("--remade", type=Path, default=None,
                   help="k = 0 runs remade on the CPU of the k = 1, 2, 4 runs of their seeds (an experiment directory "
                        "of the grpo arm, same preset)")
    p.add_argument("--cpu-check", type=Path, default=None,
                   help="k = 0 runs made again on one more CPU (an experiment directory of the grpo arm, same preset): "
                        "which of the W2 and packed k = 0 runs they repeat bit for bit (needs --reference)")
    p.add_argument("--out", type=Path, default=Path("staleness.md"))
    args = p.parse_args(argv)
    if args.cpu_check is not None and args.reference is None:
        print(f"{p.prog}: error: --cpu-check compares with the W2 runs: give --reference too", file=sys.stderr)
        return 2
    for d in (args.dir, args.reference, args.remade, args.cpu_check):
        if d is not None and not (d / "runs").is_dir():
            print(f"{p.prog}: error: {d} is not an experiment directory (no runs/)", file=sys.stderr)
            return 2
    args.out.write_text(analyse(args.dir, args.reference, args.remade, args.cpu_check))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
