"""Held-out evaluation during training (the explicit checkpoint rule).

Every ``eval.every`` steps the current policy samples ``eval.n`` completions for each held-out problem;
the results go to ``evals.jsonl`` and into that step's metrics (``eval/mean@1``, ``eval/pass@N``), and
``summary.json`` names the final and the best step, so "the baseline had already collapsed" is visible
instead of hidden behind an undisclosed checkpoint choice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshrl.jsonl import read_jsonl
from meshrl.runs.correct import is_correct
from meshrl.trainer.rollout_step import (
    PromptBudget,
    context_limit,
    encode_within_limit,
    strategy_figures,
)


class PeriodicEval:
    def __init__(self, cfg, task, tokenizer, backend, reward_runner, encode_prompt) -> None:
        self.cfg = cfg
        ev = cfg.eval
        split = ev.split if ev.split in getattr(task, "splits", ("eval",)) else None
        if split is None:
            raise ValueError(f"eval.every={ev.every} needs a held-out split {ev.split!r} in task {task.name} "
                             f"(splits: {', '.join(task.splits)}); file tasks need eval_fraction>0")
        problems = task.problems(split)
        self.problems = problems[: ev.limit] if ev.limit else problems
        if not self.problems:
            raise ValueError(f"task {task.name} split {split!r} is empty: nothing to evaluate on")
        setting = "eval.max_new_tokens" if ev.max_new_tokens else "rollout.max_new_tokens"
        budget = PromptBudget(context_limit(backend.model, tokenizer),
                              ev.max_new_tokens or cfg.rollout.max_new_tokens, setting)
        encoded = [(p, encode_within_limit(encode_prompt, tokenizer, task.format_prompt(p), budget.limit))
                   for p in self.problems]
        # A held-out prompt past the model's positions would index beyond its position table (or preallocate a
        # cache for the whole prompt) at the first evaluation: skip it, logged once, counted in every eval row.
        kept = [(p, ids) for p, ids in encoded if budget.fits(p.id, len(ids))]
        if not kept:
            raise ValueError(f"task {task.name} split {split!r}: every held-out prompt is too long for the model "
                             f"({budget.limit} positions with {setting}={budget.max_new_tokens}); nothing to "
                             f"evaluate on")
        self.problems = [p for p, _ in kept]
        self.prompts = [ids for _, ids in kept]
        self.skipped_long = len(budget.too_long)
        self.backend, self.rewards, self.task = backend, reward_runner, task
        self.tokenizer, self.encode_prompt = tokenizer, encode_prompt

    def _encode_with(self, i: int, observation: str) -> list[int]:
        """Held-out problem ``i``'s prompt with an environment's ``reset`` text appended (tool-using tasks)."""
        return self.encode_prompt(self.tokenizer, self.task.format_prompt(self.problems[i]) + observation)

    def __call__(self, step: int) -> dict[str, float]:
        from meshrl.agents import episode_metrics
        from meshrl.rollout import SamplingParams
        from meshrl.stats import pass_at_k
        from meshrl.trainer.episodes import generate_scored, transcript

        ev = self.cfg.eval
        # the held-out scoring's failures are the evaluation's, not the next training step's (its counters would
        # otherwise carry them into that step's reward/errors, where the failed-rewards check reads them)
        training_counts = self.rewards.pop_stats()
        params = SamplingParams(max_new_tokens=ev.max_new_tokens or self.cfg.rollout.max_new_tokens,
                                temperature=ev.temperature, top_p=self.cfg.rollout.top_p, n=ev.n)
        texts, probs, scores, _, episodes = generate_scored(
            self.task, self.backend, self.tokenizer, self.prompts, self.problems, params, self.cfg.seed * 7_919 + step,
            self.rewards, self._encode_with)
        eval_counts = self.rewards.pop_stats()
        for key, n in training_counts.items():
            self.rewards.stats[key] += n
        label_texts = [transcript(self.tokenizer, e) for e in episodes] if episodes else texts
        correct: dict[str, list[bool]] = {}
        for p, s in zip(probs, scores, strict=True):
            correct.setdefault(p.id, []).append(is_correct(s))
        n_prob = len(correct)
        return {
            "eval/mean@1": sum(sum(v) / len(v) for v in correct.values()) / n_prob,
            f"eval/pass@{ev.n}": sum(pass_at_k(len(v), sum(v), ev.n) for v in correct.values()) / n_prob,
            "eval/score_mean": sum(scores) / len(scores),
            "eval/skipped_long_prompts": float(self.skipped_long),  # held-out problems too long for the model
            "eval/reward_errors": float(eval_counts["reward/errors"]),  # the held-out scorer calls that failed
            "eval/reward_timeouts": float(eval_counts["reward/timeouts"]),
            # the *unconditioned* policy's strategy masses: under Mesh the training rollouts are
            # coach-conditioned, so only these held-out samples show which strategy it picks on its own
            **strategy_figures(self.task, list(zip(label_texts, scores, probs, strict=True)), prefix="eval/"),
            **({f"eval/{k}": v for k, v in episode_metrics(episodes).items()} if episodes else {}),  # tools
            **(self._by_group(correct, ev.by) if ev.by else {}),
        }

    def _by_group(self, correct: dict[str, list[bool]], field: str) -> dict[str, float]:
        """mean@1 and the problem count per value of the problems' meta ``field`` (e.g. a testbed's niche)."""
        groups: dict[str, list[float]] = {}
        for p in self.problems:
            if p.id in correct:
                v = correct[p.id]
                groups.setdefault(str(p.meta.get(field, "none")), []).append(sum(v) / len(v))
        out: dict[str, float] = {}
        for value, accs in sorted(groups.items()):
            out[f"eval/by/{value}/mean@1"] = sum(accs) / len(accs)
            out[f"eval/by/{value}/problems"] = float(len(accs))
        return out


def write_summary(run_dir: Path, key: str = "eval/mean@1") -> dict[str, Any] | None:
    """``summary.json``: the final and the best held-out step by ``key`` (None without evaluations)."""
    path = run_dir / "evals.jsonl"
    if not path.is_file():
        return None
    rows = read_jsonl(path)
    if not rows:
        return None
    best = max(rows, key=lambda r: (r[key], -r["step"]))
    summary = {"selection_metric": key, "final": rows[-1], "best": best,
               "rule": "final = last evaluated step; best = highest selection_metric (earliest on ties)"}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
