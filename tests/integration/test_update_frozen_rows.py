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


MY_TIS = """
from dataclasses import dataclass

from meshrl.settings import setting
from meshrl.trainer.plugins.rollout_corr import RolloutCorr, RolloutCorrConfig


@dataclass
class MyTisConfig(RolloutCorrConfig):
    enabled: bool = setting(True, help="on")


class MyTis(RolloutCorr):
    name = "my_tis"
    Config = MyTisConfig

    def transform(self, terms, pg_mat, agg_mask):
        return pg_mat + 0.01 * terms.logp, agg_mask, {}  # a term with a gradient where A = 0
"""


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


TIS_VARIANTS = {  # the sampler's log-probs moved off the update's (below), so that weights truncate, mask, reject
    "truncate": [], "icepop": ["plugins.rollout_corr.mode=mask"], "sequence": ["plugins.rollout_corr.level=sequence"],
    "k3": ["plugins.rollout_corr.reject=k3", "plugins.rollout_corr.reject_threshold=0.3"],
}
SETTINGS = {  # several optimiser steps per batch (old log-probs, M2PO's mask at work), other losses and aggregations
    "epochs": ["train.ppo_epochs=2", "train.mini_batches=2", "plugins.m2po.threshold=1e-9"],
    "cispo": ["recipe=cispo"], "dr_grpo": ["recipe=dr_grpo"],
    "token_mean": ["algo.loss_agg=token-mean"], "plain_speed": ["train.speed=plain"],
}


def _batch(trainer: Trainer, step: int):
    """A sampled batch with one whole group and one more row at advantage 0, the sampler's log-probs moved by up to
    +-1 per token (TIS weights from e^-1 to e, so truncation, IcePop's band and rejection act), one empty response."""
    data, _ = trainer.sampler.run(step, 0)
    g = torch.Generator().manual_seed(step)
    data.advantages = torch.randn(len(data), generator=g)
    data.advantages[:4] = 0.0
    data.advantages[9] = 0.0
    data.rollout_logps = [None if r is None else [x + float(torch.rand(1, generator=g)) * 2 - 1 for x in r]
                          for r in data.rollout_logps]
    return data


def _frozen_run(tmp_path, frozen_calls, on: list[str], *, empty_row: bool = False) -> dict[str, float]:
    fast = _trainer(tmp_path, "fast", *on)
    plain = _trainer(tmp_path, "plain", *on, "train.skip_zero_advantage=false")
    try:
        assert type(fast.engine) is SerialEngine and fast.engine.freeze_zero and not plain.engine.freeze_zero
        for step in range(2):  # the second update starts from weights the first one moved
            data = _batch(plain, step)
            zero_rows = 5
            if empty_row:  # a response cut to nothing (advantage 0: it is never frozen, having no tokens)
                data.response_ids[2] = []
                data.rollout_logps[2] = []
                zero_rows = 4
            before = len(frozen_calls)
            m = _check_equal(plain, fast, data)
            epochs = 2 if "train.ppo_epochs=2" in on else 1
            assert sum(frozen_calls[before:]) == zero_rows * epochs  # every zero row frozen, no other
        return m
    finally:
        fast.close()
        plain.close()


@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_rows_with_advantage_zero_are_frozen_and_the_update_equals_the_plain_one(tmp_path, frozen_calls, correction):
    m = _frozen_run(tmp_path, frozen_calls, CORRECTIONS[correction])
    if correction != "m2po":
        assert "rollout_corr/ess" in m and m["rollout_corr/frac_truncated"] > 0  # the weights did act


@pytest.mark.parametrize("variant", sorted(TIS_VARIANTS))
def test_every_tis_variant_equals_the_plain_update(tmp_path, frozen_calls, variant):
    m = _frozen_run(tmp_path, frozen_calls, [*CORRECTIONS["tis"], *TIS_VARIANTS[variant]])
    if variant == "k3":
        assert m["rollout_corr/frac_rejected"] > 0


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_other_losses_and_several_optimiser_steps_equal_the_plain_update(tmp_path, frozen_calls, setting):
    m = _frozen_run(tmp_path, frozen_calls, [*CORRECTIONS["both"], *SETTINGS[setting]])
    if setting == "epochs":
        assert m["m2po/masked_frac"] > 0  # the update moved off the start policy: M2PO's mask acted


def test_an_empty_response_among_frozen_rows(tmp_path, frozen_calls):
    _frozen_run(tmp_path, frozen_calls, CORRECTIONS["both"], empty_row=True)


def test_an_update_that_feeds_mei_from_its_logits_freezes_nothing(tmp_path, frozen_calls):
    """MEI's first epoch reads every row's logits in the update (rows without the sampler's features)."""
    class Collector:  # stands in for the MEI monitor: counts the rows whose logits it was shown
        rows = 0

        def add_logits(self, rows, logits, mb):
            Collector.rows += len(rows)

    fast = _trainer(tmp_path, "fast", *CORRECTIONS["tis"])
    try:
        fast.engine.mei = Collector()
        data = _batch(fast, 0)
        fast.update(data, collect_mei=True)
        assert frozen_calls == [] and Collector.rows == len(data)
        fast.update(_batch(fast, 1))
        assert sum(frozen_calls) == 5
    finally:
        fast.close()


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
                                  ["plugins.kl_cov.enabled=true"], ["plugins.custom=[{path: 'my_tis:MyTis'}]"]])
def test_the_shortcut_is_off_where_a_row_with_advantage_zero_has_a_gradient(tmp_path, monkeypatch, keys):
    # a subclass of TIS with a transform of its own does not inherit the declaration
    (tmp_path / "my_tis.py").write_text(MY_TIS)
    monkeypatch.syspath_prepend(str(tmp_path))
    t = _trainer(tmp_path, "t", *CORRECTIONS["tis"], *keys)
    try:
        assert type(t.engine) is SerialEngine and not t.engine.freeze_zero
    finally:
        t.close()
