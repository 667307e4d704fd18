"""The staleness experiment's preset and arms (preregistration_staleness.md): every arm is a valid run config with the
lag and correction it names, and a lagged arm trains on the testbed's settings (generate sampling, two
mini-batches) with the staleness it was given."""

from __future__ import annotations

from pathlib import Path

from experiments.collapse_testbed.experiment import ARMS, arm_keys, preset_settings
from meshrl.jsonl import read_jsonl
from meshrl.testbed.runconfig import base_overrides
from meshrl.trainer import load_config, train

WARM = Path(__file__).resolve().parents[1] / "warm_starts" / "W2"


def _cfg(arm: str, **changes):
    s = preset_settings("staleness", **changes)
    return load_config(overrides=[*base_overrides(s, WARM, 40), *arm_keys(arm, None), "seed=0"])


def test_every_arm_of_the_preset_is_the_lag_and_correction_it_names():
    s = preset_settings("staleness")
    assert s.arms[0] == "grpo" and len(s.arms) == 13 and s.warm == "W2" and s.steps == 160
    for arm in s.arms[1:]:
        k, correction = arm.removeprefix("grpo_k").split("_")
        cfg = _cfg(arm)
        assert cfg.rollout.max_staleness == int(k) and cfg.rollout.staleness_correction == correction
        assert cfg.rollout.sampler_process == "inline" and cfg.recipe == "grpo"
    assert _cfg("grpo").rollout.max_staleness == 0
    assert all(f"grpo_k{k}_{c}" in ARMS for k in (1, 2, 4, 8) for c in ("none", "tis", "m2po"))


def test_a_lagged_arm_trains_on_the_testbed_settings(tmp_path):
    cfg = _cfg("grpo_k2_tis", steps=3)
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 6
    train(cfg, tmp_path / "run")
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["lag/staleness_max"] for r in rows] == [0, 1, 2]
    assert all("rollout_corr/ess" in r for r in rows)
