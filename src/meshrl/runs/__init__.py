"""The run directory, owned in one place: what ``meshrl train`` writes and everything else reads.

- :mod:`~meshrl.runs.checkpoint`: atomic checkpoints (safetensors, optimizer, RNG, ``state.json`` with each
  file's size and SHA-256), the ``latest`` pointer, pruning, restore;
- :mod:`~meshrl.runs.run_dir`: preparing a fresh or resumed run directory, rewinding its records, ``config.yaml``;
- :mod:`~meshrl.runs.policy`: :func:`is_run_dir` (loading a policy from a run, and reading its config record, need
  the validated config: :func:`meshrl.trainer.load_policy`, :func:`meshrl.trainer.read_run_config`);
- :mod:`~meshrl.runs.correct`: :func:`is_correct`, the one definition of a correct rollout;
- the record format, :mod:`meshrl.jsonl` (one reader and writer, one error policy), re-exported here.

Evaluation, analysis, the doctor, export, the testbed and the integrations use this package, never the trainer's
internals.
"""

from meshrl.jsonl import JsonlWriter, iter_jsonl, read_jsonl, truncate_after_step
from meshrl.runs.checkpoint import latest_checkpoint, load_checkpoint
from meshrl.runs.correct import CORRECT_AT, is_correct
from meshrl.runs.policy import is_run_dir
from meshrl.runs.run_dir import check_out_dir

__all__ = ["CORRECT_AT", "JsonlWriter", "check_out_dir", "is_correct", "is_run_dir", "iter_jsonl", "latest_checkpoint",
           "load_checkpoint", "read_jsonl", "truncate_after_step"]
