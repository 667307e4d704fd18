"""``plugins.estr`` (entropy-scaled trust region): the keep rule against a token loop and numbers worked by hand,
the policy term it gives, its settings refused by key, and its kept behaviour entropies through JSON (across a
resume and runs on the tiny model: tests/integration/test_plugin_estr_train.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from meshrl.algos import aggregate, ppo_clip_loss
from meshrl.trainer import load_config
from meshrl.trainer.plugins import PluginContext, PluginsConfig, TokenTerms, TrainPlugins
from meshrl.trainer.plugins.estr import Estr, EstrConfig, estr_keep

CTX = PluginContext(cfg=None, recipe=None, forward=None, tokenizer=None, task=None, problems=[], seed=0,
                    rollouts=None)


def _random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    n, length = 4, 9
    logp = -torch.rand(n, length, generator=g) * 3
    old = logp + torch.randn(n, length, generator=g) * 0.5
    entropy = torch.rand(n, length, generator=g) * 2
    entropy[0, :3] = 0.0  # confident tokens
    mask = torch.ones(n, length)
    mask[2, 5:] = 0
    return logp, old, entropy, mask


def test_keep_rule_equals_a_token_loop():
    logp, old, entropy, mask = _random_case(0)
    keep, stats = estr_keep(logp, old, entropy, mask, tau=0.3, eps=0.01)
    masked = 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            d = float(logp[i, t] - old[i, t])
            inside = d * d / (float(entropy[i, t]) + 0.01) <= 0.3
            assert bool(keep[i, t]) == inside
            masked += int(bool(mask[i, t]) and not inside)
    assert stats["estr/masked_frac"] == pytest.approx(masked / float(mask.sum()))
    assert 0 < masked < mask.sum()


def test_the_bound_widens_with_entropy_by_hand():
    # the same ratio 2 (delta = log 2) at entropies 0, 0.5 and 2, tau = 1, eps = 0.01:
    # S = 0.4805 / 0.01 = 48.0 (masked), 0.4805 / 0.51 = 0.942 (kept), 0.4805 / 2.01 = 0.239 (kept)
    logp = torch.full((1, 3), math.log(2.0))
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    entropy = torch.tensor([[0.0, 0.5, 2.0]])
    keep, stats = estr_keep(logp, old, entropy, mask, tau=1.0, eps=0.01)
    assert keep.tolist() == [[0.0, 1.0, 1.0]]
    want = math.log(2.0) ** 2 * (1 / 0.01 + 1 / 0.51 + 1 / 2.01) / 3
    assert stats["estr/score_mean"] == pytest.approx(want, rel=1e-6)
    tight, _ = estr_keep(logp, old, entropy, mask, tau=0.9, eps=0.01)  # |delta| <= sqrt(0.9 * 0.51) = 0.677 < log 2
    assert tight.tolist() == [[0.0, 0.0, 1.0]]


def test_policy_term_masks_the_recipes_loss_and_keeps_the_normaliser():
    logp, old, entropy, mask = _random_case(1)
    logp = logp.requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0])
    pc = PluginsConfig()
    pc.estr.enabled, pc.estr.tau = True, 0.3
    loss_cfg = {"clip_low": 0.2, "clip_high": 0.28, "clip_dual": None}
    terms = TokenTerms(step=0, rows=list(range(4)), loss_name="ppo_clip", logp=logp, old=old, adv=adv, mask=mask,
                       entropy=entropy, loss_cfg=dict(loss_cfg), batch=None)
    ours, stats, agg = TrainPlugins(pc, CTX).policy_term(terms)
    plain, _ = ppo_clip_loss(logp, old, adv, mask, **loss_cfg)
    keep = torch.tensor([[float((float(a - b) ** 2) / (float(h) + 0.01) <= 0.3)
                          for a, b, h in zip(ra, rb, rh, strict=True)]
                         for ra, rb, rh in zip(logp.detach(), old, entropy, strict=True)])
    torch.testing.assert_close(ours, plain * keep)
    assert torch.equal(agg, mask)  # masked tokens stay in the normaliser
    want = float((plain.detach() * keep * mask).sum() / mask.sum())
    assert float(aggregate(ours.detach(), agg, "token-mean")) == pytest.approx(want)
    assert stats["estr/masked_frac"] > 0


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.estr.tau=-1", "plugins.estr.tau"),
    ("plugins.estr.eps=0", "plugins.estr.eps"),
    ("plugins.estr.enabled=true", "plugins.estr.tau"),  # no published default: it must be set
    ("plugins.estr.taus=1", "plugins.estr.taus"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_kept_entropies_round_trip_through_json_exactly():
    replay = load_config(overrides=["plugins.replay.reuse_steps=1"])
    ctx = PluginContext(cfg=replay, recipe=None, forward=None, tokenizer=None, task=None, problems=[], seed=0,
                        rollouts=None)
    plugin = Estr(EstrConfig(enabled=True, tau=1.0), ctx)
    plugin.key = "abc"
    plugin.entropy = [torch.rand(5), torch.rand(0), torch.tensor([1e-8, 3.3333333])]
    back = Estr(EstrConfig(enabled=True, tau=1.0), CTX)
    back.load_state_dict(json.loads(json.dumps(plugin.state_dict())))
    assert back.key == "abc"
    for a, b in zip(plugin.entropy, back.entropy, strict=True):
        assert torch.equal(a, b)
    empty = Estr(EstrConfig(enabled=True, tau=1.0), CTX)
    empty.load_state_dict(json.loads(json.dumps(Estr(EstrConfig(), CTX).state_dict())))
    assert empty.entropy is None and empty.key is None
    # without replay no batch is reused after a resume: the checkpoint keeps no entropies
    on_policy = Estr(EstrConfig(enabled=True, tau=1.0), PluginContext(
        cfg=load_config(), recipe=None, forward=None, tokenizer=None, task=None, problems=[], seed=0, rollouts=None))
    on_policy.key, on_policy.entropy = "abc", [torch.rand(3)]
    assert on_policy.state_dict() == {"key": None, "entropy": None}


@pytest.mark.parametrize("other", [["plugins.remix.enabled=true"],
                                   ["plugins.luffy.enabled=true", "plugins.luffy.traces=pyproject.toml"]])
def test_rows_of_other_policies_are_refused_beside_it(other):
    """remix's and luffy's rows were sampled by other policies: the start policy's entropies are not theirs."""
    with pytest.raises(ValueError, match="plugins.estr.enabled and plugins.(remix|luffy).enabled exclude"):
        load_config(overrides=["plugins.estr.enabled=true", "plugins.estr.tau=0.5", *other])
