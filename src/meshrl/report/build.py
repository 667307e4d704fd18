"""``build_report``: load run / eval directories, write the PNG plots and ``index.html`` into one folder."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from meshrl.report.alarms import alarm_marks, plot_alarms
from meshrl.report.data import load_inputs
from meshrl.report.diagnosis import diagnose_runs, diagnosis_section
from meshrl.report.html import render_html
from meshrl.report.plots import make_plots, require_matplotlib

log = logging.getLogger("meshrl.report")


def build_report(paths: Sequence[str | Path], out_dir: str | Path, *, title: str = "meshrl report") -> Path:
    """Write ``out_dir/index.html`` and its PNG plots for the given run and eval directories; the page has a
    "Diagnosis" section with ``meshrl doctor``'s findings for each run.

    Args:
        paths: run directories (``config.yaml`` / ``metrics.jsonl``) and eval directories (``eval.json``),
            in any mix and order; runs are overlaid in the order given.
        out_dir: report folder, created if needed; plots are written next to ``index.html``.
        title: page title.

    Returns:
        The path of ``index.html``.

    Raises:
        ValueError: a path is neither a run directory nor an eval directory (the message names it).
        ImportError: matplotlib (the ``report`` extra) is not installed.
    """
    runs, evals = load_inputs(paths)
    require_matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    diagnoses = diagnose_runs(runs) if runs else []
    plots = make_plots(runs, evals, out)
    alarms = plot_alarms(runs, alarm_marks(runs, diagnoses), out) if runs else None
    if alarms is not None:  # first: when it went wrong and whether meshrl said so
        plots.insert(0, alarms)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    index = out / "index.html"
    diagnosis = diagnosis_section(diagnoses) if runs else ""
    index.write_text(render_html(runs, evals, plots, title=title, generated=generated, diagnosis=diagnosis),
                     encoding="utf-8")
    log.info("report: %d run(s), %d eval(s), %d plot(s) -> %s", len(runs), len(evals), len(plots), index)
    return index
