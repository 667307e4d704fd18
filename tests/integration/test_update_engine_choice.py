"""The update engine honours every plug-in: one that acts on the update (an extra loss term, a surrogate, state set at
the update's start, a per-token hook) gets the serial engine even when it says it needs no whole micro-batch, and
trains exactly as in one plain process; one that leaves the update alone keeps the fast engine."""

from __future__ import annotations

import sys

import pytest
import torch

from meshrl.forkpool import fork_available
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config
from meshrl.trainer.update import PartsEngine, SerialEngine, update_hooks

USER_PLUGINS = '''
from dataclasses import dataclass

from meshrl.settings import setting
from meshrl.trainer.plugins import Plugin, Stage


@dataclass
class OnConfig:
    enabled: bool = setting(True, help="on")


class LogitPenalty(Plugin):
    """A term on every row's logits: a gradient even where the advantage is 0."""

    name = "logit_penalty"
    Config = OnConfig
    stage = Stage.EXTRA_LOSS

    def extra_loss(self, mb, logits, total, stats):
        term = logits.pow(2).mean()
        stats["penalty/term"] = float(term.detach())
        return total + 0.01 * term


class StepCounter(Plugin):
    """Sets state at the update's start that its loss hook reads (a forked worker would see a stale copy)."""

    name = "step_counter"
    Config = OnConfig
    stage = Stage.ADVANTAGE

    def begin_update(self, data, start_logps, ref_logps):
        self.scale = 1.0 + 0.5 * getattr(self, "scale", 0.0)
        return {}

    def shape_advantages(self, terms):
        return terms.adv * self.scale, {}


class CountPrompts(Plugin):
    """Acts at sampling only: the update is untouched."""

    name = "count_prompts"
    Config = OnConfig
    stage = Stage.SAMPLING

    def after_sampling(self, step, data, sampler):
        data.stats["prompts/count"] = float(len(set(map(tuple, data.prompt_ids))))
        return data
'''

TINY = [*TINY_RUN, "rollout.max_new_tokens=8", "optim.lr=1e-3", "train.micro_batch_size=16"]


@pytest.fixture
def user_plugins(tmp_path, monkeypatch):
    (tmp_path / "my_update_plugins.py").write_text(USER_PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_update_plugins"
    sys.modules.pop("my_update_plugins", None)


def _trainer(tmp_path, name: str, plugin: str, *extra: str) -> Trainer:
    return Trainer(load_config(overrides=[*TINY, f"plugins.custom=[{{path: '{plugin}'}}]", *extra]), tmp_path / name)


@pytest.mark.parametrize(("cls", "hooks"), [
    ("LogitPenalty", ["logit_penalty.extra_loss"]),
    ("StepCounter", ["step_counter.begin_update", "step_counter.shape_advantages"]),
])
def test_a_plugin_acting_on_the_update_gets_the_serial_engine_and_trains_as_one_plain_process(
        tmp_path, user_plugins, cls, hooks):
    plugin = f"{user_plugins}:{cls}"
    workers = 2 if fork_available() else 1
    fast = _trainer(tmp_path, "fast", plugin, f"train.update_workers={workers}")
    plain = _trainer(tmp_path, "plain", plugin, "train.update_workers=1", "train.skip_zero_advantage=false")
    try:
        assert update_hooks(fast.plugins) == hooks
        assert type(fast.engine) is SerialEngine and not fast.engine.freeze_zero  # its terms are not A times f(r)
        for step in range(2):
            data, _ = plain.sampler.run(step, 0)
            data.advantages[:4] = 0.0  # one group whose gradient is only the plug-in's
            m_fast, m_plain = fast.update(data), plain.update(data)
            assert m_fast == m_plain
            if cls == "LogitPenalty":
                assert "penalty/term" in m_fast
            for p, q in zip(fast.model.parameters(), plain.model.parameters(), strict=True):
                assert torch.equal(p, q)
    finally:
        fast.close()
        plain.close()


def test_a_plugin_that_leaves_the_update_alone_keeps_the_fast_engine(tmp_path, user_plugins):
    t = _trainer(tmp_path, "t", f"{user_plugins}:CountPrompts", "train.update_workers=1")
    try:
        assert update_hooks(t.plugins) == [] and isinstance(t.engine, PartsEngine) and t.engine.skip_zero
    finally:
        t.close()
