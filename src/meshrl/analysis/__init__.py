"""Offline analyses of a policy (engine layer 3): MEI calibration, strategy census, accessibility probe.

- :func:`calibrate_mei`: per-query MEI of the model before RL; ``threshold = mean + 3 std`` for the
  trainer's early warning (``meshrl mei calibrate``).
- :func:`census`: epsilon-strategies and their masses per query from logged rollouts, via exact (or
  sketched) Fisher scores and the coupling kernel (``meshrl census``).
- :func:`probe`: per coach strategy, accuracy when conditioned on it and the log-probability of its text
  under the unconditioned prompt (``meshrl probe``).

Every entry point takes a model spec, a meshrl run directory or ``RUN_DIR/checkpoints/step_N``
(:func:`meshrl.trainer.load_policy`) and returns a JSON-ready dict (NaN where undefined; use
:func:`nan_to_none` before ``json.dumps`` for strict JSON).
"""

from meshrl.analysis._common import expand_param_names, forward_response, nan_to_none, pad_id_of, sequence_logprobs
from meshrl.analysis.calibrate import CALIBRATION_FEATURES, calibrate_mei
from meshrl.analysis.census import DEFAULT_GROUP_KEY, REQUIRED_FIELDS, census, read_rollout_rows
from meshrl.analysis.probe import probe

__all__ = [
    "forward_response",
    "pad_id_of",
    "sequence_logprobs",
    "CALIBRATION_FEATURES",
    "DEFAULT_GROUP_KEY",
    "REQUIRED_FIELDS",
    "calibrate_mei",
    "census",
    "expand_param_names",
    "nan_to_none",
    "probe",
    "read_rollout_rows",
]
