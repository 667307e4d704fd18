"""plugins.opsd: bad settings named by key, and which teacher keeps a reference model (the self-distillation term
against a per-token loop, in the trainer: tests/integration/test_plugin_opsd_train.py)."""

from __future__ import annotations

import pytest

from meshrl.trainer import load_config
from meshrl.trainer.plugins import plugins_need_reference


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.opsd.coef=0", "plugins.opsd.coef"),
    ("plugins.opsd.topk=0", "plugins.opsd.topk"),
    ("plugins.opsd.loss_max=0", "plugins.opsd.loss_max"),
    ("plugins.opsd.context=solution", "plugins.opsd.context"),
    ("plugins.opsd.teacher=ema", "plugins.opsd.teacher"),
    ("plugins.opsd.loss=reverse_kl", "plugins.opsd.loss"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_only_the_initial_teacher_keeps_a_reference():
    assert plugins_need_reference(load_config(overrides=["plugins.opsd.enabled=true"]).plugins)
    assert not plugins_need_reference(load_config(overrides=["plugins.opsd.enabled=true",
                                                             "plugins.opsd.teacher=current"]).plugins)
    assert not plugins_need_reference(load_config(overrides=["plugins.opsd.teacher=initial"]).plugins)
    assert plugins_need_reference(load_config(overrides=["plugins.dpo.enabled=true"]).plugins)
