"""``meshrl doctor``: why did an RL run go wrong, from the run's own records (layer 3, engine).

``diagnose(RUN)`` reads a meshrl run directory, a TRL output directory (``trainer_state.json``, TensorBoard
events) or a verl log (file-logger JSONL, TensorBoard events) into one form (:class:`RunRecords`, meshrl's
metric names), runs every check (``CHECKS``) against the thresholds of :class:`Thresholds` and returns a
:class:`Diagnosis`: findings (what, at which steps, the evidence, how sure, which knob helps) and the
checks that could not run for lack of a metric. docs/doctor.md lists every check and threshold.
"""

from meshrl.doctor.diagnose import CHECKS, Diagnosis, diagnose, diagnose_records
from meshrl.doctor.engines import TRL_NAMES, VERL_NAMES, load_run
from meshrl.doctor.findings import Finding, Unchecked
from meshrl.doctor.records import RunRecords
from meshrl.doctor.render import render_text
from meshrl.doctor.thresholds import DEFAULT, Thresholds

__all__ = ["CHECKS", "DEFAULT", "TRL_NAMES", "VERL_NAMES", "Diagnosis", "Finding", "RunRecords", "Thresholds",
           "Unchecked", "diagnose", "diagnose_records", "load_run", "render_text"]
