"""The plug-in seam: every built-in plug-in is one registered class in one file, declared settings with help, and a
plug-in from the user's own module (``plugins.custom``) trains without touching meshrl."""

from __future__ import annotations

import math
import pkgutil
import sys

import pytest

from meshrl.settings import iter_settings
from meshrl.testing import TINY_RUN
from meshrl.trainer import load_config, train
from meshrl.trainer.plugins import REGISTRY, Plugin, PluginContext, PluginsConfig, Stage, TrainPlugins
from meshrl.trainer.plugins import __path__ as PLUGINS_PATH

TINY = [*TINY_RUN, "steps=2", "train.update_workers=1"]
SCALE_PLUGIN = '''
from dataclasses import dataclass

from meshrl.settings import setting
from meshrl.trainer.plugins import Plugin, Stage


@dataclass
class ScaleConfig:
    enabled: bool = setting(True, help="on")
    factor: float = setting(1.0, ge=0, help="multiply every advantage by this")


class ScaleAdvantage(Plugin):
    name = "scale_adv"
    Config = ScaleConfig
    stage = Stage.ADVANTAGE

    def shape_advantages(self, terms):
        return terms.adv * self.cfg.factor, {"scale/factor": self.cfg.factor}
'''


def test_each_builtin_module_registers_one_plugin_named_after_it():
    modules = {m.name for m in pkgutil.iter_modules(PLUGINS_PATH)} - {"base", "host", "config"}
    assert modules == set(REGISTRY)
    for name, cls in REGISTRY.items():
        assert cls.name == name and cls.__module__ == f"meshrl.trainer.plugins.{name}"
        assert isinstance(cls.stage, Stage) and cls.summary
        docs = list(iter_settings(cls.Config))
        assert docs and all(d.help for d in docs), f"plugins.{name}: a field without help"


def test_every_plugins_key_is_documented():
    missing = [d.key for d in iter_settings(PluginsConfig) if not d.help]
    assert not missing


def test_hooks_run_in_stage_order():
    pc = PluginsConfig()
    for name in ("rollout_corr", "fork", "entropy_adv", "m2po", "kl_cov"):
        getattr(pc, name).enabled = True
    ctx = PluginContext(cfg=None, recipe=None, forward=None, tokenizer=None, task=None, problems=[], seed=0,
                        rollouts=None)
    order = [p.name for p in TrainPlugins(pc, ctx).active]
    assert order == ["entropy_adv", "kl_cov", "m2po", "fork", "rollout_corr"]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_plugins.py").write_text(SCALE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_plugins:ScaleAdvantage"
    sys.modules.pop("my_plugins", None)


def test_a_user_plugin_by_import_path_trains(tmp_path, user_module):
    plain = train(load_config(overrides=TINY), tmp_path / "plain")
    same = train(load_config(overrides=[*TINY, f"plugins.custom=[{{path: '{user_module}', factor: 1.0}}]"]),
                 tmp_path / "same")
    zero = train(load_config(overrides=[*TINY, f"plugins.custom=[{{path: '{user_module}', factor: 0.0}}]"]),
                 tmp_path / "zero")
    for a, b in zip(plain, same, strict=True):  # factor 1 changes nothing
        assert b["scale/factor"] == 1.0 and b["loss/policy"] == a["loss/policy"] and b["grad/norm"] == a["grad/norm"]
    assert all(m["grad/norm"] == 0.0 and math.isfinite(m["loss/total"]) for m in zero)  # no advantage, no gradient


@pytest.mark.parametrize(("entry", "message"), [
    ("{path: 'no_such_module:X'}", r"plugins\.custom\[0\]\.path 'no_such_module:X': cannot import"),
    ("{path: 'math:pi'}", r"plugins\.custom\[0\]\.path 'math:pi' is not a meshrl Plugin"),
    ("{factor: 1.0}", r"plugins\.custom\[0\] must be a mapping with path"),
    ("{path: 'my_plugins:ScaleAdvantage', facto: 1.0}", r"plugins\.custom\[0\]\.facto"),
    ("{path: 'my_plugins:ScaleAdvantage', factor: -1.0}", r"plugins\.custom\[0\]\.factor=-1\.0"),
])
def test_bad_user_plugins_are_refused_by_key(user_module, entry, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=[*TINY, f"plugins.custom=[{entry}]"])


def test_plugin_base_hooks_change_nothing():
    assert all(getattr(Plugin, hook) is not None for hook in ("shape_advantages", "transform", "after_sampling"))
    assert Plugin.is_enabled(type("C", (), {"enabled": True})()) and not Plugin.is_enabled(object())


TERM_PLUGIN = '''
from dataclasses import dataclass

from meshrl.settings import setting
from meshrl.trainer.plugins import Plugin, Stage


@dataclass
class TermConfig:
    enabled: bool = setting(True, help="on")
    value: float = setting(0.25, help="the per-step term reported")


class ConstantTerm(Plugin):
    name = "const_term"
    Config = TermConfig
    stage = Stage.EXTRA_LOSS

    def begin_update(self, data, start_logps, ref_logps):
        return {"const/term": self.cfg.value}
'''


def test_any_plugins_term_is_added_to_the_total_loss(tmp_path, monkeypatch):
    """docs/plugins.md: a plug-in's ``<ns>/term`` from begin_update is part of ``loss/total`` (not only DPO's)."""
    (tmp_path / "term_plugin.py").write_text(TERM_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        plain = train(load_config(overrides=TINY), tmp_path / "plain")
        with_term = train(load_config(overrides=[*TINY, "plugins.custom=[{path: 'term_plugin:ConstantTerm'}]"]),
                          tmp_path / "term")
    finally:
        sys.modules.pop("term_plugin", None)
    for a, b in zip(plain, with_term, strict=True):
        assert b["const/term"] == 0.25
        assert b["loss/total"] == pytest.approx(a["loss/total"] + 0.25, abs=1e-12)


STATE_PLUGINS = '''
from dataclasses import dataclass

from meshrl.settings import setting
from meshrl.trainer.plugins import Plugin, Stage


@dataclass
class CountConfig:
    enabled: bool = setting(True, help="on")
    start: int = setting(0, help="first count")


class CountA(Plugin):
    name = "count_a"
    Config = CountConfig
    stage = Stage.EXTRA_LOSS

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.count = cfg.start

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"] if state else self.cfg.start


class CountB(CountA):
    name = "count_b"
'''


def test_custom_plugin_state_follows_the_plugin_not_its_position(tmp_path, monkeypatch):
    (tmp_path / "state_plugins.py").write_text(STATE_PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    ctx = PluginContext(cfg=None, recipe=None, forward=None, tokenizer=None, task=None, problems=[], seed=0,
                        rollouts=None)
    a, b = {"path": "state_plugins:CountA", "start": 1}, {"path": "state_plugins:CountB", "start": 2}
    try:
        saved = TrainPlugins(load_config(overrides=[*TINY, f"plugins.custom=[{a}, {b}]"]).plugins, ctx).state_dict()
        swapped = TrainPlugins(load_config(overrides=[*TINY, f"plugins.custom=[{b}, {a}]"]).plugins, ctx)
        swapped.load_state_dict(saved)
        counts = {type(p).__name__: p.count for p in swapped.active}
        assert counts == {"CountA": 1, "CountB": 2}
        with pytest.raises(ValueError, match=r"plugins\.custom\[1\]\.path 'state_plugins:CountA' is listed twice"):
            load_config(overrides=[*TINY, f"plugins.custom=[{a}, {a}]"])
    finally:
        sys.modules.pop("state_plugins", None)
