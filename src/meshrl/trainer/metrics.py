"""A step's rollout metrics: rewards, accuracy, lengths, grouping, strategy masses (``metrics.jsonl``)."""

from __future__ import annotations

from typing import Any

import torch

from meshrl.doctor.grouping import grouping_metrics
from meshrl.runs.correct import CORRECT_AT, is_correct
from meshrl.trainer.rollout_step import strategy_figures
from meshrl.trainer.step_data import StepData


def rollout_metrics(data: StepData) -> dict[str, float]:
    """Reward, score, accuracy, advantage, length and grouping figures of the rows the update trained on."""
    if not len(data):  # every group filtered (DAPO): still report the reward and accuracy of what was sampled
        if not data.seen:
            return {}
        return {"reward/mean": data.stats["reward/sampled_mean"],
                "acc/mean": sum(float(is_correct(sc)) for _, sc, _ in data.seen) / len(data.seen)}
    scores = torch.tensor(data.scores)
    lengths = torch.tensor([len(r) for r in data.response_ids], dtype=torch.float32)
    return {
        "reward/mean": float(data.rewards.mean()),
        "reward/std": float(data.rewards.std()) if len(data) > 1 else 0.0,
        "score/mean": float(scores.mean()),
        "acc/mean": float((scores >= CORRECT_AT).float().mean()),
        "adv/abs_mean": float(data.advantages.abs().mean()),
        "len/response_mean": float(lengths.mean()),
        "len/response_max": float(lengths.max()),
        "len/truncated_frac": float(torch.tensor(data.truncated, dtype=torch.float32).mean()),
        **grouping_metrics(data.group_ids, data.query_ids, data.strategy_ids, [p.id for p in data.problems],
                           data.rewards.tolist(), data.advantages.tolist()),
    }


def strategy_metrics(task: Any, data: StepData) -> dict[str, float]:
    """Strategy masses and accuracy per type over every rollout sampled this step (before a dynamic-sampling
    filter: they describe the policy), and the sampled accuracy."""
    seen = data.seen or list(zip(data.texts, data.scores, data.problems, strict=True))
    if not seen:
        return {}
    return {"acc/sampled_mean": sum(float(is_correct(sc)) for _, sc, _ in seen) / len(seen),
            **strategy_figures(task, seen)}
