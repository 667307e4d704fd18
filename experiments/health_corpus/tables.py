"""Markdown tables of a scored corpus (``score.summarize``): ``results.md``.

Column meanings (``score.rates``): *detected* = harmful runs where it fired at all / harmful runs it could check;
*in time* = fired at or before the held-out harm step / checked harmful runs with a harm step; *lead* = median
(harm step - first onset), positive = warned first; *delay* = median (first onset - fault step) for deliberate
failures; *healthy fired* = healthy runs with any onset / checked healthy runs; *FA/100* = onsets per 100 logged
steps on the checked healthy runs; *healthy on* = share of the evaluated healthy steps at which it was on (one
onset that never clears counts once in FA/100); *unchecked* = runs (harmful or healthy) it could not check.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from experiments.health_corpus.score import FA_LIMIT, REF_STEPS

HEAD = "| {} | detected | in time | lead | delay | healthy fired | FA/100 | healthy on | unchecked |"


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _frac(a: int, b: int) -> str:
    return f"{a}/{b}" if b else "-"


def rate_cells(r: dict[str, Any]) -> list[str]:
    return [_frac(r["detected"], r["checked_harmful"]), _frac(r["in_time"], r["with_harm"]), _num(r["lead_median"]),
            _num(r["delay_median"]), _frac(r["healthy_fired"], r["checked_healthy"]), _num(r["fa_per_100"], 2),
            _num(r["healthy_on_share"], 2), str(r["unchecked"])]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(first: str, n_cols: int) -> list[str]:
    return [HEAD.format(first), "|" + "---|" * (n_cols + 1)]


def corpus_table(labels: list[dict[str, Any]]) -> list[str]:
    """Runs per source, kind, outcome and split; harmful testbed runs whose niche was kept at the end."""
    counts = Counter((lab["source"], lab["kind"], lab["outcome"], lab["split"]) for lab in labels)
    back = Counter((lab["source"], lab["kind"], lab["outcome"]) for lab in labels if lab.get("recovered"))
    keys = sorted({k[:3] for k in counts})
    out = ["| source | kind | outcome | tune | report | of them recovered by the end |", "|---|---|---|---|---|---|"]
    out += [_row([s, k, o, str(counts[(s, k, o, "tune")]), str(counts[(s, k, o, "report")]),
                  str(back[(s, k, o)]) if o == "harmful" else "-"]) for s, k, o in keys]
    return out


def overall_table(block: dict[str, dict[str, Any]], first: str) -> list[str]:
    """One row per check / signal, all kinds pooled."""
    out = _header(first, 8)
    out += [_row([name, *rate_cells(kinds["all"])]) for name, kinds in block.items()]
    return out


def kind_table(block: dict[str, dict[str, Any]], kinds: list[str], first: str) -> list[str]:
    """Per group (harmful kind, or source): in time (runs with a harm step) or detected (deliberate failures
    without one)."""
    out = ["| " + first + " | " + " | ".join(kinds) + " |", "|" + "---|" * (len(kinds) + 1)]
    for name, by in block.items():
        cells = []
        for k in kinds:
            r = by.get(k)
            if r is None or not r["harmful"]:
                cells.append("-")
            elif not r["checked_harmful"]:
                cells.append("unchecked")
            else:
                parts = [f"{_frac(r['in_time'], r['with_harm'])} in time" if r["with_harm"] else
                         f"{_frac(r['detected'], r['checked_harmful'])} det"]
                if r["delay_median"] is not None:
                    parts.append(f"delay {_num(r['delay_median'])}")
                if r["pre_fault"]:
                    parts.append(f"{r['pre_fault']} onset(s) before the fault")
                cells.append(", ".join(parts))
        out.append(_row([name, *cells]))
    return out


def _key(v: float) -> str:
    return f"{v:g}"


def sweep_summary(sweeps: dict[str, dict[str, Any]], first: str) -> list[str]:
    """Per swept signal / threshold: the value chosen on tune and its tune and report figures."""
    out = [f"| {first} | chosen | tune: hits / harmful | tune FA/100 | report: detected | report: in time | "
           "report lead | report healthy fired | report FA/100 | report healthy on |", "|" + "---|" * 10]
    for name, sw in sweeps.items():
        v = sw["chosen"]
        if v is None:
            out.append(_row([name, sw["why_none"], *["-"] * 8]))
            continue
        t, r = sw["tune"][v], sw["report"][v]
        out.append(_row([name, _key(v), _frac(t["hits"], t["harmful"]), _num(t["fa_per_100"], 2),
                         _frac(r["detected"], r["checked_harmful"]), _frac(r["in_time"], r["with_harm"]),
                         _num(r["lead_median"]), _frac(r["healthy_fired"], r["checked_healthy"]),
                         _num(r["fa_per_100"], 2), _num(r["healthy_on_share"], 2)]))
    return out


def sweep_grid_table(name: str, sw: dict[str, Any]) -> list[str]:
    out = [f"**{name}**", "", "| threshold | tune hits | tune FA/100 | report hits | report in time | report lead | "
           "report FA/100 | report healthy on |", "|---|---|---|---|---|---|---|---|"]
    for v in sw["grid"]:
        t, r = sw["tune"][v], sw["report"][v]
        mark = " (chosen)" if v == sw["chosen"] else ""
        out.append(_row([_key(v) + mark, _frac(t["hits"], t["harmful"]), _num(t["fa_per_100"], 2),
                         _frac(r["hits"], r["harmful"]), _frac(r["in_time"], r["with_harm"]),
                         _num(r["lead_median"]), _num(r["fa_per_100"], 2), _num(r["healthy_on_share"], 2)]))
    return out + [""]


def coverage_table(cov: dict[str, dict[str, Any]]) -> list[str]:
    """Per harmful kind: runs caught by some doctor finding, by any detector, and the best single detector."""
    out = ["| kind | harmful runs | caught by a doctor finding | caught by any detector | best detector (runs) |",
           "|---|---|---|---|---|"]
    for kind, row in cov.items():
        best = f"{row['best'][0]} ({row['best'][1]})" if row["best"] else "none"
        out.append(_row([kind, str(row["runs"]), str(row["doctor_any"]), str(row["any"]), best]))
    return out


def render(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    labels = summary["labels"]
    kinds = sorted({lab["kind"] for lab in labels if lab["outcome"] == "harmful"})
    sources = sorted({lab["source"] for lab in labels if lab["outcome"] == "harmful"})
    lines = ["# The doctor on its labelled corpus", "",
             f"{summary['runs']} runs; the live doctor evaluated every {settings.get('every', 1)} step(s); tuning "
             f"rule: on the tune half, the threshold catching the most harmful runs (at or before the harm step "
             f"where one is known) with at most {FA_LIMIT:g} false-alarm onsets per 100 healthy steps; ties: fewer "
             "false alarms, then the smaller value; no threshold when none within the limit catches a run. A "
             "deliberate failure's alarm is its first onset from the fault step. Entropy reference: mean of the "
             f"first {REF_STEPS} logged values. Ambiguous runs are left out of every rate. Column meanings: "
             "experiments/health_corpus/README.md.", "", "## Corpus", "", *corpus_table(labels), "",
             "## Live doctor, shipped thresholds (warning and alarm onsets)", "",
             *overall_table(summary["doctor"], "finding"), "", "Per harmful kind:", "",
             *kind_table(summary["doctor"], kinds, "finding"), "", "Per source (harmful runs of every kind):", "",
             *kind_table(summary["doctor_by_source"], sources, "finding"), "",
             "## Raw signals at the doctor's thresholds", "",
             *overall_table({k: v for k, v in summary["signals_shipped"].items() if v}, "signal"), "",
             "Signals without a shipped threshold on these runs: "
             + (", ".join(k for k, v in summary["signals_shipped"].items() if not v) or "none") + ".", "",
             "## Threshold sweeps: tuned on tune, reported on report", "",
             *sweep_summary(summary["signal_sweeps"], "raw signal"), "",
             *sweep_summary(summary["doctor_sweeps"], "doctor threshold"), "",
             "Raw signals tuned within each model family (source up to its first '/'; the family's own tune and "
             "report halves):", "",
             *sweep_summary({f"{src}: {name}": sw for src, block in summary["signal_sweeps_by_source"].items()
                             for name, sw in block.items() if sw["grid"]}, "family: raw signal"), "",
             "### Grids (all sources pooled)", ""]
    for name, sw in [*summary["signal_sweeps"].items(), *summary["doctor_sweeps"].items()]:
        if sw["grid"]:
            lines += sweep_grid_table(name, sw)
    cov = summary["coverage"]
    missed = [k for k, row in cov.items() if not row["any"]]
    lines += ["## What no signal catches", "",
              "Caught = alarmed at or before the harm step (deliberate failures without one: alarmed from the fault "
              "step on); detectors: every doctor finding at its shipped thresholds, the raw signals at a shipped "
              "threshold, and every swept signal or doctor threshold at its tuned value (both halves).", "",
              *coverage_table(cov), "",
              ("Kinds no detector catches on any run: " + ", ".join(missed)) if missed else
              "Every harmful kind is caught on at least one run by some detector.", ""]
    errors = summary.get("errors", {})
    if errors:
        lines += ["## Checks that raised", "", "| what | runs |", "|---|---|",
                  *(_row([k, str(n)]) for k, n in sorted(errors.items())), ""]
    return "\n".join(lines)
