"""The serial update engine's zero-advantage shortcut: with plug-ins whose terms vanish with the advantage (TIS,
M2PO: ``Plugin.zero_advantage_exact``), rows with advantage 0 are forwarded without a graph and enter the loss as
constants, so that the plug-ins' batch statistics and the metrics still see the whole micro-batch. The update must
equal the plain one (every row's backward) up to float rounding, metrics included."""

from __future__ import annotations

import pytest
import torch

from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config
from meshrl.trainer.loss import Objective
from meshrl.trainer.update import SerialEngine

TINY = [*TINY_RUN, "rollout.max_new_tokens=8", "train.micro_batch_size=6"]  # micro-batches cut across groups
CORRECTIONS = {"tis": ["plugins.rollout_corr.enabled=true"], "m2po": ["plugins.m2po.enabled=true"],
               "both": ["plugins.rollout_corr.enabled=true", "plugins.m2po.enabled=true"]}


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    return Trainer(load_config(overrides=[*TINY, *extra]), tmp_path / name)


@pytest.fixture
def frozen_calls(monkeypatch):
    """How many rows each micro-batch froze (the shortcut ran, and on which rows)."""
    calls: list[int] = []
    original = Objective.micro_loss_frozen

    def spy(self, rows, mb, inputs, frozen):
        calls.append(len(frozen))
        return original(self, rows, mb, inputs, frozen)

    monkeypatch.setattr(Objective, "micro_loss_frozen", spy)
    return calls


def _check_equal(plain: Trainer, fast: Trainer, data) -> dict[str, float]:
    m_plain, m_fast = plain.update(data), fast.update(data)
    assert set(m_plain) == set(m_fast)
    for k, v in m_plain.items():
        if k.startswith("time/"):
            continue
        assert m_fast[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for p, q in zip(plain.model.parameters(), fast.model.parameters(), strict=True):
        torch.testing.assert_close(q, p)
    return m_fast


@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_rows_with_advantage_zero_are_frozen_and_the_update_equals_the_plain_one(tmp_path, frozen_calls, correction):
    on = CORRECTIONS[correction]
    fast = _trainer(tmp_path, "fast", *on)
    plain = _trainer(tmp_path, "plain", *on, "train.skip_zero_advantage=false")
    try:
        assert type(fast.engine) is SerialEngine and fast.engine.freeze_zero and not plain.engine.freeze_zero
        for step in range(2):  # the second update starts from weights the first one moved
            data, _ = plain.sampler.run(step, 0)
            data.advantages = torch.randn(len(data), generator=torch.Generator().manual_seed(step))
            data.advantages[:4] = 0.0  # one whole group
            data.advantages[9] = 0.0  # and one row of another
            before = len(frozen_calls)
            m = _check_equal(plain, fast, data)
            assert sum(frozen_calls[before:]) == 5  # every zero row frozen, no other
            if "rollout_corr" in on[0]:
                assert "rollout_corr/ess" in m
    finally:
        fast.close()
        plain.close()


def test_a_batch_with_every_advantage_zero_still_steps_every_parameter(tmp_path, frozen_calls):
    """One row keeps its graph (the shortest): AdamW then steps every parameter with its zero gradient, as the
    plain update does (a parameter without a gradient is not stepped at all, not even by weight decay)."""
    fast = _trainer(tmp_path, "fast", *CORRECTIONS["tis"], "optim.weight_decay=0.1")
    plain = _trainer(tmp_path, "plain", *CORRECTIONS["tis"], "optim.weight_decay=0.1",
                     "train.skip_zero_advantage=false")
    try:
        data, _ = plain.sampler.run(0, 0)
        data.advantages = torch.zeros(len(data))
        start = [p.detach().clone() for p in fast.model.parameters()]
        _check_equal(plain, fast, data)
        assert sum(frozen_calls) == len(data) - 1
        assert all(not torch.equal(p, s) for p, s in zip(fast.model.parameters(), start, strict=True))
    finally:
        fast.close()
        plain.close()


@pytest.mark.parametrize("keys", [["train.skip_zero_advantage=false"], ["recipe=grpo_kl"],
                                  ["plugins.kl_cov.enabled=true"]])
def test_the_shortcut_is_off_where_a_row_with_advantage_zero_has_a_gradient(tmp_path, keys):
    t = _trainer(tmp_path, "t", *CORRECTIONS["tis"], *keys)
    try:
        assert type(t.engine) is SerialEngine and not t.engine.freeze_zero
    finally:
        t.close()
