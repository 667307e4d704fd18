"""``plugins.future_kl`` (FIPO) in the trainer: runs on the tiny model (on-policy: plain GRPO exactly; a reused batch;
other recipes and plug-ins). The influence weights, the policy term and the settings:
tests/unit/test_plugin_future_kl.py."""

from __future__ import annotations

import math

import pytest

from meshrl.testing import tiny_config
from meshrl.trainer import train


def test_two_steps_on_tiny(tmp_path):
    hist = train(tiny_config("plugins.future_kl.enabled=true", "train.ppo_epochs=2"), tmp_path / "fipo")
    assert [m["step"] for m in hist] == [1, 2]
    for m in hist:
        for key in ("fipo/weight_mean", "fipo/future_kl_mean", "fipo/clip_frac_high", "loss/total", "grad/norm"):
            assert math.isfinite(m[key]), key
        assert 1.0 <= m["fipo/weight_mean"] <= 1.2  # clip_high_only: the weights only amplify


def test_on_policy_it_is_plain_grpo(tmp_path):
    # one optimiser step per batch: every ratio is 1, FutureKL 0, every weight 1
    plain = train(tiny_config("train.update_workers=1", "train.skip_zero_advantage=false"), tmp_path / "plain")
    fipo = train(tiny_config("plugins.future_kl.enabled=true", "plugins.future_kl.clip_high_only=false"),
                 tmp_path / "fipo")
    for a, b in zip(plain, fipo, strict=True):
        assert b["fipo/weight_mean"] == 1.0 and b["fipo/future_kl_mean"] == 0.0
        assert b["loss/policy"] == a["loss/policy"] and b["grad/norm"] == a["grad/norm"]


def test_it_acts_on_a_reused_batch(tmp_path):
    hist = train(tiny_config("plugins.replay.reuse_steps=1", "plugins.future_kl.enabled=true",
                             "plugins.future_kl.clip_high_only=false", "optim.lr=1e-2", steps=2), tmp_path / "r")
    assert hist[0]["fipo/future_kl_mean"] == 0.0 and hist[1]["fipo/future_kl_mean"] != 0.0
    assert hist[1]["fipo/weight_mean"] != 1.0


@pytest.mark.parametrize("extra", [
    ["recipe=mesh", "rollout.prompts_per_step=2", "mesh.m=2", "mesh.mu=0.1"],
    ["recipe=dapo", "algo.dynamic_sampling=false", "plugins.estr.enabled=true", "plugins.estr.tau=0.5"],
])
def test_it_composes_with_other_recipes_and_plugins(tmp_path, extra):
    hist = train(tiny_config(*extra, "plugins.future_kl.enabled=true", "train.mini_batches=2"), tmp_path / "c")
    assert all(math.isfinite(m["fipo/weight_mean"]) and math.isfinite(m["grad/norm"]) for m in hist)
