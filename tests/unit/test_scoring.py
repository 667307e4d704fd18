"""meshrl.trainer.scoring: grades from the reward function or the environment, the coach's conditioned score,
DAPO's overlong shaping and the recipe's group advantages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshrl.algos import recipe
from meshrl.trainer.scoring import Scoring
from meshrl.trainer.step_data import Sample, StepData


def _data(strategies):
    data = StepData()
    for i, k in enumerate(strategies):
        data.append(Sample(prompt_ids=[1], response_ids=[5] * (2 + 2 * i), text=f"t{i}", truncated=False,
                           problem=SimpleNamespace(id="p"), group_id=0, query_id=0, strategy_id=k, score=0.0))
    return data


class Runner:
    def __init__(self):
        self.stats = {"reward/errors": 0, "reward/timeouts": 0}

    def __call__(self, texts, problems):
        return [0.5 * i for i in range(len(texts))]


def test_grades_and_the_coachs_conditioned_score():
    task = SimpleNamespace(conditioned_score=lambda s, t, p, prefix: s + (1.0 if prefix == "b" else 0.0))
    s = Scoring(task=task, reward_runner=Runner(), recipe=recipe("grpo"), max_new_tokens=8,
                prefixes={"p": ["a", "b"]})
    data = _data([0, 1, -1])
    s.grade(data)
    assert data.scores == [0.0, 1.5, 1.0]  # strategy 1's prefix "b" adds 1; the bare row (-1) is unchanged
    env = SimpleNamespace(owns_reward=True, conditioned_score=task.conditioned_score)
    data = _data([-1, -1])
    Scoring(task=env, reward_runner=Runner(), recipe=recipe("grpo"), max_new_tokens=8).grade(data, [1, 0.25])
    assert data.scores == [1.0, 0.25]


def test_overlong_shaping_and_advantages():
    dapo = recipe("dapo")
    s = Scoring(task=None, reward_runner=Runner(), recipe=dapo, max_new_tokens=8)
    data = _data([-1, -1, -1])  # responses of 2, 4, 6 tokens against a limit of 8
    data.scores = [1.0, 1.0, 1.0]
    shaped = s.shape_rewards(data)
    assert shaped[0] == 1.0 and shaped[2] <= shaped[1] <= 1.0
    adv = s.advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), [0, 0, 1, 1])
    assert adv.tolist() == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-3)
