"""Plain-text rendering of a :class:`~meshrl.doctor.diagnose.Diagnosis` (the CLI's default output)."""

from __future__ import annotations

import json
import textwrap
from typing import Any

MARK = {"alarm": "!!", "warning": "! ", "info": "i "}


def _evidence_lines(evidence: dict[str, Any]) -> list[str]:
    out = []
    for k, v in evidence.items():
        if k == "also":
            out += [f"also explains: {x}" for x in v]
        else:
            out.append(f"{k}: {json.dumps(v) if isinstance(v, dict | list) else v}")
    return out


def render_text(diag, *, width: int = 100) -> str:
    lines = [f"meshrl doctor: {diag.path} ({diag.engine} run, {diag.steps_logged} logged steps)"]
    alarming = diag.alarming()
    lines.append(f"{len(diag.findings)} finding(s), {len(alarming)} above info; {len(diag.passed)} check(s) "
                 f"passed; {len(diag.unchecked)} could not be checked")
    wrap = textwrap.TextWrapper(width=width, initial_indent="    ", subsequent_indent="      ")
    for f in diag.findings:
        steps = ", ".join(str(s) for s in f.steps[:10]) + (" ..." if len(f.steps) > 10 else "")
        lines += ["", f"{MARK[f.severity]} [{f.severity}] {f.title} ({f.id}) at step(s) {steps}; confidence "
                      f"{f.confidence}"]
        lines += wrap.wrap(f.what)
        lines += wrap.wrap("evidence: " + "; ".join(_evidence_lines(f.evidence)))
        lines += [f"    sample {s}" for s in f.samples]
        lines += wrap.wrap(f"knob: {f.knob}")
    if not diag.findings:
        lines += ["", "nothing found: every check that could run passed"]
    if diag.unchecked:
        lines += ["", "not checked:"]
        lines += [f"  - {u.id}: {u.reason}" for u in diag.unchecked]
    if diag.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in diag.notes]
    return "\n".join(lines) + "\n"
