"""Sampled evaluation of a policy on a benchmark (engine layer)."""

from meshrl.evaluation.runner import EvalConfig, run_eval, summarize

__all__ = ["EvalConfig", "run_eval", "summarize"]
