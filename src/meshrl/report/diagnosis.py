"""The report's "Diagnosis" section: ``meshrl doctor``'s findings for each run, escaped HTML."""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshrl.report.data import RunData

log = logging.getLogger("meshrl.report")

CSS = """
.finding { border-left: 5px solid #999; padding: 0.3em 0.8em; margin: 0.6em 0; background: #fafafa; }
.finding.alarm { border-color: #c62828; } .finding.warning { border-color: #ef8f00; }
.finding.info { border-color: #1e88e5; }
.finding .sev { font-weight: bold; text-transform: uppercase; font-size: 0.8em; }
.finding pre { white-space: pre-wrap; font-size: 0.8em; background: #f3f3f3; padding: 0.3em; }
"""


def e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def diagnose_runs(runs: Sequence[RunData]) -> list[tuple[str, Any]]:
    """``(run label, Diagnosis or the error text)`` for each run (a run the doctor cannot read gets its reason)."""
    from meshrl.doctor import diagnose

    out: list[tuple[str, Any]] = []
    for run in runs:
        try:
            out.append((run.label, diagnose(run.path, engine="meshrl")))
        except (ValueError, OSError) as err:
            log.info("%s: doctor could not read the run (%s)", run.path, err)
            out.append((run.label, f"not diagnosed: {err}"))
        except Exception as err:  # noqa: BLE001 - a failing check costs this run's section, not the report
            log.warning("%s: doctor failed (%s: %s); the report has no diagnosis for it", run.path,
                        type(err).__name__, err, exc_info=True)
            out.append((run.label, f"not diagnosed: the doctor failed ({type(err).__name__}: {err})"))
    return out


def _finding(f) -> str:
    steps = ", ".join(str(s) for s in f.steps[:10]) + (" ..." if len(f.steps) > 10 else "")
    evidence = json.dumps(f.evidence, indent=1, default=str)
    samples = "".join(f"<li><code>{e(s)}</code></li>" for s in f.samples)
    return (f'<div class="finding {e(f.severity)}" data-finding="{e(f.id)}">'
            f'<span class="sev">{e(f.severity)}</span> <b>{e(f.title)}</b> (<code>{e(f.id)}</code>) at step(s) '
            f"{e(steps)}; confidence {e(f.confidence)}<p>{e(f.what)}</p>"
            f"<p><b>Knob:</b> {e(f.knob)}</p><details><summary>evidence</summary><pre>{e(evidence)}</pre></details>"
            + (f"<ul class=\"note\">{samples}</ul>" if samples else "") + "</div>")


def diagnosis_section(diagnosed: Sequence[tuple[str, Any]]) -> str:
    """``<section id="diagnosis">`` with one block per run: findings by severity, then what was not checked."""
    parts = ['<section id="diagnosis">', "<h2>Diagnosis</h2>",
             '<p class="note">Findings of <code>meshrl doctor</code> from each run\'s own records; checks and '
             "thresholds in docs/doctor.md.</p>"]
    for label, diag in diagnosed:
        parts.append(f'<div class="run-diagnosis" data-run="{e(label)}"><h3>{e(label)}</h3>')
        if isinstance(diag, str):
            parts.append(f'<p class="note">{e(diag)}</p></div>')
            continue
        alarming = len(diag.alarming())
        parts.append(f"<p>{len(diag.findings)} finding(s), {alarming} above info; {len(diag.passed)} check(s) "
                     f"passed; {len(diag.unchecked)} not checked.</p>")
        parts += [_finding(f) for f in diag.findings] or ['<p class="ok">Nothing found.</p>']
        if diag.unchecked:
            items = "".join(f"<li><code>{e(u.id)}</code>: {e(u.reason)}</li>" for u in diag.unchecked)
            parts.append(f'<details class="unchecked"><summary>not checked ({len(diag.unchecked)})</summary>'
                         f'<ul class="note">{items}</ul></details>')
        parts.append("</div>")
    parts.append("</section>")
    return "\n".join(parts)


def write_diagnosis_page(diag, out_dir: Path, *, title: str) -> Path:
    """``out_dir/index.html`` holding only the Diagnosis section (for TRL / verl runs, which ``meshrl report``
    does not plot)."""
    from meshrl.report.html import CSS as PAGE_CSS

    out_dir.mkdir(parents=True, exist_ok=True)
    label = f"{diag.path.name} ({diag.engine})"
    page = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', f"<title>{e(title)}</title>",
            f"<style>{PAGE_CSS}{CSS}</style>", "</head>", "<body>", f"<h1>{e(title)}</h1>",
            diagnosis_section([(label, diag)]), "</body>", "</html>", ""]
    index = out_dir / "index.html"
    index.write_text("\n".join(page), encoding="utf-8")
    return index
