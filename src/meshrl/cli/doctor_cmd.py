"""``meshrl doctor RUN_DIR``: findings about a training run from its own records (text, JSON, HTML)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="diagnose a training run (meshrl, TRL or verl) from its own records",
                       description="Reads a run's per-step metrics, samples, events and evaluations and prints "
                       "each finding: what happened, at which steps, the evidence, how sure, and which knob "
                       "usually helps; lists the checks a missing metric prevented. Checks and thresholds: "
                       "docs/doctor.md. Exit status 0, or 3 with --fail-on and a finding at that severity.")
    p.add_argument("run", type=Path, metavar="RUN_DIR",
                   help="meshrl run directory, TRL output directory, or verl file-logger JSONL (file or folder)")
    p.add_argument("--engine", choices=["auto", "meshrl", "trl", "verl"], default="auto",
                   help="how to read RUN_DIR (default: detected)")
    p.add_argument("--samples", type=Path, metavar="DIR",
                   help="a verl run's generation dumps (trainer.rollout_data_dir: <step>.jsonl files), so the "
                        "checks on completions run (a TRL run's completions/ folder is read by itself)")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON instead of text")
    p.add_argument("--html", type=Path, metavar="OUT", help="also write an HTML report (plots + Diagnosis) to OUT/")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a threshold (e.g. --set grad_spike_factor=5); names in docs/doctor.md")
    p.add_argument("--fail-on", choices=["alarm", "warning"], help="exit 3 when a finding has this severity or worse")
    p.set_defaults(func=run)


def _thresholds(pairs: list[str]):
    from meshrl.doctor import DEFAULT

    overrides = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set {pair!r}: expected NAME=VALUE")
        overrides[name.strip()] = value.strip()
    try:
        return DEFAULT.with_overrides(overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--set: {e}") from e


def run(args: argparse.Namespace) -> int:
    from meshrl.doctor import diagnose, render_text

    diag = diagnose(args.run, engine=args.engine, thresholds=_thresholds(args.set), samples=args.samples)
    out = json.dumps(diag.to_dict(), indent=2, allow_nan=False) + "\n" if args.json else render_text(diag)
    print(out, end="")
    if args.html is not None:
        index = _write_html(diag, args)
        if index is None:
            return 1
        print(index, file=sys.stderr)
    severities = {"alarm": ("alarm",), "warning": ("alarm", "warning")}.get(args.fail_on or "", ())
    return 3 if any(f.severity in severities for f in diag.findings) else 0


def _write_html(diag, args: argparse.Namespace) -> Path | None:
    """The run report with its Diagnosis section (meshrl runs: plots need matplotlib), or a page with the
    Diagnosis alone (TRL, verl)."""
    from meshrl.report import build_report
    from meshrl.report.diagnosis import write_diagnosis_page

    title = f"meshrl doctor: {args.run.name}"
    if diag.engine != "meshrl":
        return write_diagnosis_page(diag, args.html, title=title)
    try:
        return build_report([args.run], args.html, title=title)
    except ImportError as e:
        print(f"meshrl doctor: error: {e}", file=sys.stderr)
        return None
