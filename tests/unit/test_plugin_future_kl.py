"""``plugins.future_kl`` (FIPO): the influence weights against a token-by-token loop and numbers worked by hand,
the policy term it gives, and its settings refused by key (runs on the tiny model:
tests/integration/test_plugin_future_kl_train.py)."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algos import ppo_clip_loss
from meshrl.trainer import load_config
from meshrl.trainer.plugins import PluginContext, PluginsConfig, TokenTerms, TrainPlugins
from meshrl.trainer.plugins.future_kl import FutureKlConfig, fipo_weights


def _loop_weights(logp, old, adv, mask, cfg: FutureKlConfig) -> torch.Tensor:
    """FIPO's weights written out one token at a time (an independent path to the vectorised code)."""
    n, length = logp.shape
    gamma = 2.0 ** (-1.0 / cfg.decay_rate)
    out = torch.ones(n, length, dtype=torch.float64)
    for i in range(n):
        for t in range(length):
            total = 0.0
            for k in range(t, length):
                d = min(max(float(logp[i, k] - old[i, k]), -20.0), 20.0)
                if mask[i, k] and math.exp(d) <= cfg.filter_ratio:
                    total += gamma ** (k - t) * d
            w = math.exp(total)
            if cfg.clip_range > 0:
                w = min(max(w, 1.0 if cfg.clip_high_only else 1.0 - cfg.clip_range), 1.0 + cfg.clip_range)
            else:
                w = min(w, 10.0)
            d_t = float(logp[i, t] - old[i, t])
            a = float(adv[i]) if adv.dim() == 1 else float(adv[i, t])
            if a < 0 and math.exp(d_t) > cfg.safety_threshold:
                w = min(max(w, 0.8), 1.0)
            out[i, t] = w
    return out


def _random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    n, length = 5, 11
    logp = -torch.rand(n, length, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(n, length, generator=g, dtype=torch.float64) * 0.8  # some ratios past 2, 3, 10
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.ones(n, length)
    mask[1, 7:] = 0  # a short row
    mask[3, 4] = 0  # a hole
    mask[4] = 0  # an empty row
    return logp, old, adv, mask


@pytest.mark.parametrize("options", [
    {},
    {"clip_high_only": False},
    {"clip_range": 0.0, "decay_rate": 4.0},
    {"clip_high_only": False, "safety_threshold": 1.5, "filter_ratio": 2.0, "decay_rate": 2.0},
])
def test_weights_equal_a_token_by_token_loop(options):
    cfg = FutureKlConfig(enabled=True, **options)
    for seed in range(3):
        logp, old, adv, mask = _random_case(seed)
        ours, _ = fipo_weights(logp, old, adv, mask, cfg)
        want = _loop_weights(logp, old, adv, mask, cfg)
        valid = mask.bool()
        torch.testing.assert_close(ours[valid], want[valid])


def test_weights_worked_by_hand():
    # decay_rate 1: gamma = 1/2; ratios 2 and 1/2: FutureKL = [log 2 + log(1/2)/2, log(1/2)] = [log(2)/2, -log 2]
    logp, old = torch.log(torch.tensor([[2.0, 0.5]])), torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    free = FutureKlConfig(enabled=True, decay_rate=1.0, clip_range=0.0)
    w, stats = fipo_weights(logp, old, torch.tensor([1.0]), mask, free)
    torch.testing.assert_close(w, torch.tensor([[2.0**0.5, 0.5]]))
    assert stats["fipo/future_kl_mean"] == pytest.approx(-math.log(2) / 4)
    clipped, _ = fipo_weights(logp, old, torch.tensor([1.0]), mask, FutureKlConfig(enabled=True, decay_rate=1.0))
    torch.testing.assert_close(clipped, torch.tensor([[1.2, 1.0]]))  # [1, 1 + 0.2]
    both, _ = fipo_weights(logp, old, torch.tensor([1.0]), mask,
                           FutureKlConfig(enabled=True, decay_rate=1.0, clip_high_only=False))
    torch.testing.assert_close(both, torch.tensor([[1.2, 0.8]]))
    # a negative advantage with ratio 2 > safety 1.5: the first weight is held in [0.8, 1]
    safe, stats = fipo_weights(logp, old, torch.tensor([-1.0]), mask,
                               FutureKlConfig(enabled=True, decay_rate=1.0, clip_range=0.0, safety_threshold=1.5))
    torch.testing.assert_close(safe, torch.tensor([[1.0, 0.5]]))
    assert stats["fipo/safety_frac"] == 0.5
    # ratio 2 above c = 1.5: token 0 adds nothing, FutureKL_0 = log(1/2)/2
    filtered, _ = fipo_weights(logp, old, torch.tensor([1.0]), mask,
                               FutureKlConfig(enabled=True, decay_rate=1.0, clip_range=0.0, filter_ratio=1.5))
    torch.testing.assert_close(filtered, torch.tensor([[0.5**0.5, 0.5]]))


def test_on_policy_weights_are_exactly_one():
    logp, _, adv, mask = _random_case(0)
    w, stats = fipo_weights(logp, logp.detach(), adv, mask, FutureKlConfig(enabled=True, clip_high_only=False))
    assert torch.equal(w[mask.bool()], torch.ones_like(w[mask.bool()]))
    assert stats["fipo/weight_mean"] == 1.0 and stats["fipo/future_kl_mean"] == 0.0


def test_policy_term_is_the_recipes_loss_on_the_weighted_advantages():
    logp, old, adv, mask = _random_case(1)
    logp = logp.float().requires_grad_(True)
    old, adv = old.float(), adv.float()
    pc = PluginsConfig()
    pc.future_kl.enabled, pc.future_kl.clip_high_only = True, False
    ctx = PluginContext(cfg=None, recipe=None, forward=None, tokenizer=None, task=None, problems=[], seed=0,
                        rollouts=None)
    loss_cfg = {"clip_low": 0.2, "clip_high": 0.28, "clip_dual": 3.0}
    terms = TokenTerms(step=0, rows=list(range(5)), loss_name="ppo_clip", logp=logp, old=old, adv=adv, mask=mask,
                       entropy=torch.zeros_like(old), loss_cfg=dict(loss_cfg), batch=None)
    ours, stats, _ = TrainPlugins(pc, ctx).policy_term(terms)
    weight = torch.tensor(_loop_weights(logp.detach(), old, adv, mask, pc.future_kl).tolist())
    want, _ = ppo_clip_loss(logp, old, adv.unsqueeze(-1) * weight, mask, **loss_cfg)
    torch.testing.assert_close(ours, want)
    assert stats["fipo/weight_mean"] != 1.0


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.future_kl.decay_rate=0", "plugins.future_kl.decay_rate"),
    ("plugins.future_kl.clip_range=-0.1", "plugins.future_kl.clip_range"),
    ("plugins.future_kl.safety_threshold=0", "plugins.future_kl.safety_threshold"),
    ("plugins.future_kl.filter_ratio=1", "plugins.future_kl.filter_ratio"),
    ("plugins.future_kl.decay=3", "plugins.future_kl.decay"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])
