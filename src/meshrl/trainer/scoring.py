"""Scoring one step's rows: grades (the task's reward function, or an environment's own reward), the coach's
conditioned score, the recipe's reward shaping and its advantages over the step's groups."""

from __future__ import annotations

from typing import Any

import torch

from meshrl.agents.environment import count_reward_failures
from meshrl.algos import Recipe, advantage_estimator, overlong_penalty
from meshrl.trainer.step_data import StepData


class Scoring:
    """What turns sampled rows into the update's targets, for one run (see the module docstring)."""

    def __init__(self, *, task: Any, reward_runner: Any, recipe: Recipe, max_new_tokens: int,
                 prefixes: dict[str, list[str]] | None = None) -> None:
        self.task, self.rewards, self.recipe = task, reward_runner, recipe
        self.max_new_tokens, self.prefixes = max_new_tokens, prefixes

    def grade(self, data: StepData, env_rewards: list[Any] | None = None) -> None:
        """Set ``data.scores``: the environment's rewards when the task owns its reward (``env_rewards``, one per
        row; their failures counted as the reward function's would: reward/errors, failure.max_reward_failed), else
        the task's reward function; then, under a coach, ``Task.conditioned_score`` (e.g. a coach-following reward;
        the default leaves the score unchanged)."""
        if getattr(self.task, "owns_reward", False):
            if env_rewards is None:
                raise ValueError(f"task {getattr(self.task, 'name', self.task)!r} owns its reward: grade() needs the "
                                 "environments' rewards of its episodes")
            count_reward_failures(env_rewards, self.rewards)
            data.scores = [float(r) for r in env_rewards]
        else:
            data.scores = self.rewards(data.texts, data.problems)
        if self.prefixes is not None:
            data.scores = [self.task.conditioned_score(s, t, p, self.prefixes[p.id][k]) if k >= 0 else s
                           for s, t, p, k in zip(data.scores, data.texts, data.problems, data.strategy_ids,
                                                 strict=True)]

    def shape_rewards(self, data: StepData) -> torch.Tensor:
        """Task score plus DAPO's soft overlong penalty when the recipe asks for it."""
        r = torch.tensor(data.scores, dtype=torch.float32)
        if self.recipe.overlong_shaping and len(data):
            max_len = self.max_new_tokens
            cache = max(1, int(round(self.recipe.overlong_cache_frac * max_len)))
            lengths = torch.tensor([len(x) for x in data.response_ids], dtype=torch.float32)
            r = r + overlong_penalty(lengths, max_len, cache, self.recipe.overlong_factor)
        return r

    def advantages(self, rewards: torch.Tensor, group_ids: list[Any]) -> torch.Tensor:
        """The recipe's advantage estimator (``Recipe.advantage``, looked up in ``meshrl.algos``) over the groups."""
        scale = "none" if self.recipe.adv_scale == "none" else "std"
        return advantage_estimator(self.recipe.advantage)(rewards, group_ids, scale=scale)
