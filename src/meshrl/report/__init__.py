"""Run reports (layer 4 face): PNG plots overlaying runs and eval directories, and one ``index.html``.

``build_report([RUN_DIR, EVAL_DIR, ...], OUT_DIR)`` or ``meshrl report RUN_DIR... --out OUT_DIR``.
Needs matplotlib (the ``report`` extra), imported only when plots are drawn.
"""

from meshrl.report.build import build_report
from meshrl.report.data import EvalData, RunData, load_eval, load_inputs, load_run
from meshrl.report.plots import Plot, make_plots

__all__ = ["EvalData", "Plot", "RunData", "build_report", "load_eval", "load_inputs", "load_run", "make_plots"]
