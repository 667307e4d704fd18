"""Verifiable rewards: strict final-answer extraction, graders per answer kind, a timed batch runner.

- :func:`extract_answer`: the last ``\\boxed{}``, else the last ``<answer>`` tag, else a final
  "answer is X" / "#### X" statement; never the raw completion.
- :func:`grade`: ``grade(completion, reference, kind) -> 1.0 | 0.0`` for kinds :data:`REWARD_KINDS`
  (``math`` uses math-verify, the optional extra ``meshrl[math]``).
- :class:`RewardRunner`: applies a scorer to a batch with a per-item timeout, clamps to [0, 1] and counts
  errors and timeouts (:meth:`RewardRunner.pop_stats`).
"""

from meshrl.rewards.extract import extract_answer, extract_boxed
from meshrl.rewards.grading import REWARD_KINDS, grade, grade_answer, math_equal, symbolic_equal
from meshrl.rewards.normalize import choice_letter, normalize_exact, normalize_latex, parse_number
from meshrl.rewards.runner import RewardError, RewardRunner, scorer_time_limit
from meshrl.rewards.sandbox import SandboxResult, extract_code, grade_code, run_code

__all__ = [
    "REWARD_KINDS",
    "RewardError",
    "RewardRunner",
    "scorer_time_limit",
    "SandboxResult",
    "choice_letter",
    "extract_answer",
    "extract_boxed",
    "extract_code",
    "grade_code",
    "grade",
    "grade_answer",
    "math_equal",
    "normalize_exact",
    "normalize_latex",
    "parse_number",
    "run_code",
    "symbolic_equal",
]
