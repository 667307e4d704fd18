"""``plugins.remix`` (ReMix, Liang et al. 2025): the mix-policy PPG loss against hand-worked numbers, and bounds and
recipes refused by key (the trainer's side and training on the tiny model:
tests/integration/test_plugin_remix_train.py)."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algos import ppo_clip_loss
from meshrl.trainer import load_config
from meshrl.trainer.plugins.remix import mix_ppg_loss


def test_mix_ppg_loss_equals_the_formula_token_by_token():
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, -0.7]])
    behaviour = torch.tensor([[-1.3, -0.5, -1.0], [-0.9, -1.4, -0.7]])
    start = torch.tensor([[-1.1, -0.9, -1.2], [-0.2, -1.4, -0.4]])
    adv = torch.tensor([1.5, -0.8])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    mat, _ = mix_ppg_loss(logp, behaviour, start, adv, mask, clip_low=0.2, clip_high=0.28)
    for i in range(2):
        for t in range(3):
            r = math.exp(logp[i, t] - behaviour[i, t])
            c = math.exp(start[i, t] - behaviour[i, t])
            a = float(adv[i])
            want = -min(r * a, min(max(r, c - 0.2), c + 0.28) * a)
            assert float(mat[i, t]) == pytest.approx(want, rel=1e-6, abs=1e-7), (i, t)
    # behaviour = start (fresh rows, c = 1): the PPO clip
    ppo, _ = ppo_clip_loss(logp, start, adv, mask, clip_low=0.2, clip_high=0.28)
    same, _ = mix_ppg_loss(logp, start, start, adv, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(same, ppo)


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.remix.off_policy_frac=1", "plugins.remix.off_policy_frac"),
    ("plugins.remix.window=0", "plugins.remix.window"),
    ("plugins.remix.beta=-1", "plugins.remix.beta"),
    ("plugins.remix.lambda_max=1.5", "plugins.remix.lambda_max"),
    ("plugins.remix.decay_every=0", "plugins.remix.decay_every"),
    ("plugins.remix.reincarnate_at=-1", "plugins.remix.reincarnate_at"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


@pytest.mark.parametrize(("extra", "match"), [
    (["recipe=grpo_kl"], r"algo\.kl_coef=0"),
    (["algo.policy_loss=cispo"], r"plain ppo_clip"),
    (["plugins.replay.reuse_steps=1"], r"replay"),
])
def test_incompatible_settings_are_refused(extra, match):
    with pytest.raises(ValueError, match=match):
        load_config(overrides=["plugins.remix.enabled=true", *extra])


def test_lambda_bounds_are_checked_even_when_off():
    with pytest.raises(ValueError, match=r"plugins\.remix\.lambda_min=0\.9 exceeds plugins\.remix\.lambda_max"):
        load_config(overrides=["plugins.remix.lambda_min=0.9", "plugins.remix.lambda_max=0.8"])
