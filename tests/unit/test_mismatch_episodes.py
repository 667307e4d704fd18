"""The sampler-vs-trainer log-prob mismatch on multi-turn episodes: only the model's tokens are compared (the
sampler never scored the tool's output between turns; its log-probs there are placeholders)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshrl.trainer.mismatch import MismatchMonitor


def _data(rollout_logps, response_ids):
    return SimpleNamespace(rollout_logps=rollout_logps, response_ids=response_ids, rollout_log_kept=None,
                           origin=[""] * len(response_ids), unsampled=[0] * len(response_ids))


def test_episode_rows_compare_the_models_tokens_only():
    # row 0: an episode, tokens 2-3 are the tool's (placeholder 0.0 from the sampler, anything from the trainer)
    # row 1: single-turn, every token the model's
    data = _data([[-0.5, -1.0, 0.0, 0.0, -2.0], [-0.1, -0.2]], [[1, 2, 3, 4, 5], [6, 7]])
    mon = MismatchMonitor()
    mon.begin(data, skip=set())
    old = torch.tensor([[-0.5, -1.0, -7.0, -9.0, -2.25], [-0.1, -0.2, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    mon.observe([0, 1], old, mask)
    stats = mon.finish()
    assert stats["mismatch/logp_absdiff_max"] == pytest.approx(0.25)  # token 4 of the episode; tool tokens ignored
    assert stats["mismatch/logp_absdiff_mean"] == pytest.approx(0.25 / 5)  # over the 5 model tokens


def test_a_row_is_kept_from_its_first_pass_only():
    data = _data([[-1.0, -1.0]], [[1, 2]])
    mon = MismatchMonitor()
    mon.begin(data, skip=set())
    mon.observe([0], torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2))
    mon.observe([0], torch.tensor([[-9.0, -9.0]]), torch.ones(1, 2))  # a later epoch: pi_old is the first pass
    assert mon.finish()["mismatch/logp_absdiff_max"] == pytest.approx(0.5)
