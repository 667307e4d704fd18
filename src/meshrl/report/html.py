"""The self-contained ``index.html`` of ``meshrl report``: run tables, eval comparison, plots, notes.

Every piece of text from the inputs (directory names, config values, notes) goes through
``html.escape``; plots are referenced as relative PNG files that sit next to the page.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from meshrl.report.data import EvalData, RunData, as_number, dig
from meshrl.report.diagnosis import CSS as DIAGNOSIS_CSS
from meshrl.report.plots import Plot

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; max-width: 1000px; } .note { color: #666; font-size: 0.85em; }
code { background: #f6f6f6; padding: 0 0.2em; }
"""

# (label, dotted config key) shown for every run; values missing from config.yaml show as "-".
SETTINGS = [
    ("rollout", None),
    ("prompts per step", "rollout.prompts_per_step"), ("group size G", "rollout.group_size"),
    ("max new tokens", "rollout.max_new_tokens"), ("temperature", "rollout.temperature"),
    ("backend", "rollout.backend"), ("learning rate", "optim.lr"),
    ("KL coef", "resolved_recipe.kl_coef"), ("JS coef", "resolved_recipe.js_coef"),
    ("advantage", "resolved_recipe.advantage"), ("policy loss", "resolved_recipe.policy_loss"),
    ("mesh", None),
    ("mesh.base", "mesh.base"), ("mesh.m (prefixes)", "mesh.m"), ("mesh.placement", "mesh.placement"),
    ("mesh.budget", "mesh.budget"), ("mesh.adv_unit", "mesh.adv_unit"), ("mesh.mu", "mesh.mu"),
    ("balance mu (resolved)", "resolved_mesh.balance_mu"),
    ("MEI", None),
    ("feature", "diag.mei.feature"), ("every", "diag.mei.every"), ("threshold (config)", "diag.mei.threshold"),
    ("patience", "diag.mei.patience"),
]


def e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt(value: Any) -> str:
    """Numbers to 4 significant digits, everything else as text; ``None`` as "-"."""
    if value is None:
        return "-"
    num = as_number(value)
    if num is not None and not isinstance(value, bool):
        return str(int(num)) if isinstance(value, int) else f"{num:.4g}"
    return str(value)


def _rows(pairs: Sequence[tuple[str, Any]]) -> str:
    out = []
    for key, value in pairs:
        if value is None and key.startswith("§"):
            out.append(f'<tr><th colspan="2">{e(key[1:])}</th></tr>')
        else:
            out.append(f"<tr><th>{e(key)}</th><td>{e(fmt(value))}</td></tr>")
    return "\n".join(out)


def _held_out(run: RunData, which: str) -> str | None:
    rec = run.held_out(which)
    if rec is None:
        return None
    values = ", ".join(f"{k} {fmt(v)}" for k, v in rec.items() if k != "step" and as_number(v) is not None)
    return f"step {fmt(rec['step'])}: {values}" if values else f"step {fmt(rec['step'])}"


def run_section(run: RunData) -> str:
    cfg = run.config
    crossing, logged = run.mei_first_crossing()
    pairs: list[tuple[str, Any]] = [
        ("directory", str(run.path)), ("recipe", run.recipe), ("model", cfg.get("model")), ("task", cfg.get("task")),
        ("steps (config)", cfg.get("steps")), ("last logged step", run.records[-1]["step"] if run.records else None),
        ("seed", cfg.get("seed")),
        ("held-out selection metric", (run.summary or {}).get("selection_metric")),
        ("final held-out", _held_out(run, "final")), ("best held-out", _held_out(run, "best")),
        ("rollouts/count (sum)", run.total("rollouts/count")),
        ("MEI threshold (used)", run.mei_threshold()),
        ("MEI first crossing step",
         None if crossing is None else f"{fmt(crossing)} ({'logged' if logged else 'from data'})"),
    ]
    for label, key in SETTINGS:
        pairs.append((f"§{label}", None) if key is None else (label, dig(cfg, key)))
    if "resolved_mesh" not in cfg:
        pairs.append(("mesh settings active", "no (not a Mesh recipe)"))
    notes = "".join(f"<li>{e(n)}</li>" for n in run.notes)
    return (f"<h3>{e(run.label)}</h3>\n<table>\n{_rows(pairs)}\n</table>\n"
            + (f'<ul class="note">{notes}</ul>\n' if notes else ""))


def _k_of(key: str) -> tuple[int, int]:
    head, _, k = key.partition("@")
    return (int(k) if k.isdigit() else 0, 0 if head == "mean" else 1)


def eval_table(evals: Sequence[EvalData]) -> str:
    metric_keys = sorted({k for ev in evals for k in ev.overall if "@" in k}, key=_k_of)
    head = ["eval dir", "model", "data", "split", "n", "limit", "problems", *metric_keys]
    lines = ["<table>", "<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    for ev in evals:
        cfg = ev.config
        cells = [ev.label, cfg.get("model"), cfg.get("data"), cfg.get("split"), cfg.get("n"), cfg.get("limit"),
                 ev.overall.get("problems")] + [ev.overall.get(k) for k in metric_keys]
        lines.append("<tr>" + "".join(f"<td>{e(fmt(c))}</td>" for c in cells) + "</tr>")
    lines.append("</table>")
    notes = [f"{ev.label}: {n}" for ev in evals for n in ev.notes]
    if notes:
        lines.append('<ul class="note">' + "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul>")
    return "\n".join(lines)


def plot_figure(plot: Plot) -> str:
    missing = (f'<br><span class="note">no data in: {e(", ".join(plot.missing))}</span>' if plot.missing else "")
    return (f'<figure id="{e(plot.file)}">\n<img src="{e(plot.file)}" alt="{e(plot.title)}">\n'
            f"<figcaption><b>{e(plot.title)}.</b> {e(plot.caption)}<br><b>MEI scale:</b> {e(plot.mei_scale)}"
            f"{missing}</figcaption>\n</figure>")


def render_html(runs: Sequence[RunData], evals: Sequence[EvalData], plots: Sequence[Plot], *, title: str,
                generated: str, diagnosis: str = "") -> str:
    """The page; ``diagnosis`` is the ready "Diagnosis" section (:func:`meshrl.report.diagnosis.diagnosis_section`),
    placed before the run tables."""
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', f"<title>{e(title)}</title>",
        f"<style>{CSS}{DIAGNOSIS_CSS}</style>", "</head>", "<body>", f"<h1>{e(title)}</h1>",
        f'<p class="note">Generated {e(generated)} by <code>meshrl report</code> from {len(runs)} run '
        f"director{'y' if len(runs) == 1 else 'ies'} and {len(evals)} eval director"
        f"{'y' if len(evals) == 1 else 'ies'}.</p>",
        "<h2>Note on MEI scales</h2>",
        "<p>MEI = ||&Sigma;&phi;<sub>i</sub>||&sup2; / &Sigma;||&phi;<sub>i</sub>||&sup2; over a set of rollouts. "
        "The <b>query scale</b> (<code>mei/query</code>, solid lines) takes all G rollouts of a query (for Mesh "
        "runs, across all prefix groups): 1 = orthogonal, G = identical, so effective directions = G / MEI. The "
        "<b>prefix-group scale</b> (<code>mei/prefix_group</code>, dashed) takes the g rollouts within one "
        "coach-prefix group, range [0, g]. Thresholds are calibrated on, and apply to, the query scale. Each "
        "plot's caption says which scale it shows.</p>",
    ]
    if diagnosis:  # first: what went wrong is what a reader opens the page for
        parts.append(diagnosis)
    if runs:
        parts.append("<h2>Runs</h2>")
        parts += [run_section(run) for run in runs]
    if evals:
        parts += ["<h2>Evaluations</h2>", eval_table(evals)]
    parts.append("<h2>Plots</h2>")
    parts += [plot_figure(p) for p in plots] if plots else ['<p class="note">No plottable data.</p>']
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)
