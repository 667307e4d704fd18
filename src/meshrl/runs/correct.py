"""When a rollout counts as correct: its task score reaches 1 (with float tolerance). One definition for the
trainer's accuracy, the evaluation's pass@k, the analyses, DPO's pairs, the prompt filter and the integrations."""

from __future__ import annotations

CORRECT_AT = 1.0 - 1e-6


def is_correct(score: float) -> bool:
    """True when ``score`` (a task score in [0, 1]) reaches :data:`CORRECT_AT`."""
    return score >= CORRECT_AT
