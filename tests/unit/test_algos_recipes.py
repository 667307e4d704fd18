"""Recipe presets: the numbers each paper prescribes, internal consistency, and use end to end."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshrl.algos import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    RECIPES,
    Recipe,
    advantage_estimator,
    aggregate,
    js_divergence,
    kl_penalty,
    policy_loss,
    recipe,
)

# docs/method.md §2 names these presets; "mesh" and "cp_only" wrap a base recipe elsewhere.
METHOD_NAMES = {"grpo", "grpo_kl", "grpo_js", "dapo", "gspo", "gspo_token"}


def test_design_presets_exist() -> None:
    assert set(RECIPES) >= METHOD_NAMES


def test_grpo_preset() -> None:
    r = recipe("grpo")
    assert (r.advantage, r.adv_scale, r.policy_loss) == ("grpo", "std", "ppo_clip")
    assert (r.clip_low, r.clip_high, r.clip_dual) == (0.2, 0.2, None)
    assert r.loss_agg == "seq-mean-token-mean"
    assert r.kl_coef == 0.0 and r.js_coef == 0.0 and not r.needs_reference
    assert not r.dynamic_sampling and not r.overlong_shaping


def test_dapo_preset() -> None:
    r = recipe("dapo")
    assert (r.clip_low, r.clip_high) == (0.2, 0.28)
    assert r.loss_agg == "token-mean"
    assert r.dynamic_sampling and r.overlong_shaping
    assert r.overlong_cache_frac == pytest.approx(4096 / 20480)  # DAPO's L_cache / L_max
    assert r.policy_loss == "ppo_clip" and r.kl_coef == 0.0


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_presets(name: str) -> None:
    r = recipe(name)
    assert r.policy_loss == name
    assert (r.clip_low, r.clip_high) == (3e-4, 4e-4)
    assert r.loss_agg == "seq-mean-token-mean"


def test_kl_and_js_presets_need_the_reference() -> None:
    kl, js = recipe("grpo_kl"), recipe("grpo_js")
    assert kl.kl_coef > 0 and kl.kl_kind == "k3" and kl.needs_reference
    assert js.js_coef > 0 and js.js_mode == "exact" and js.needs_reference
    assert kl.js_coef == 0.0 and js.kl_coef == 0.0


def test_dr_grpo_preset_drops_std_and_length_normalisation() -> None:
    r = recipe("dr_grpo")
    assert (r.advantage, r.adv_scale, r.loss_agg) == ("dr_grpo", "none", "seq-mean-token-sum-norm")


def test_cispo_preset() -> None:
    r = recipe("cispo")
    assert (r.policy_loss, r.clip_high, r.loss_agg) == ("cispo", 0.28, "token-mean")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_preset_refers_to_registered_parts(name: str) -> None:
    r = recipe(name)
    assert r.name == name
    assert r.advantage in ADVANTAGE_ESTIMATORS
    assert r.adv_scale in ("std", "none")
    assert r.policy_loss in POLICY_LOSSES
    assert r.loss_agg in AGG_MODES
    assert r.kl_kind in KL_ESTIMATORS
    assert r.js_mode in ("exact", "sampled")
    assert 0 < r.overlong_cache_frac <= 1 and r.overlong_factor >= 0
    assert r.notes  # every preset says where its numbers come from


def test_unknown_recipe_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"recipe 'ppo'.*dapo.*grpo.*gspo"):
        recipe("ppo")


def test_recipes_are_frozen_and_replace_checks_fields() -> None:
    r = recipe("grpo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.clip_high = 0.3  # type: ignore[misc]
    tuned = r.replace(clip_high=0.28, kl_coef=0.01)
    assert (tuned.clip_high, tuned.kl_coef, tuned.needs_reference) == (0.28, 0.01, True)
    assert recipe("grpo").clip_high == 0.2  # the preset itself is untouched
    with pytest.raises(ValueError, match="clip_hi"):
        r.replace(clip_hi=0.3)


def test_to_dict_round_trips() -> None:
    r = recipe("dapo")
    assert Recipe(**r.to_dict()) == r


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_preset_runs_end_to_end(name: str, gen: torch.Generator) -> None:
    # The trainer's path through the pure functions: advantages -> policy loss -> aggregation
    # (+ reference terms), ending in a finite scalar with a gradient.
    r = recipe(name)
    b, t, v = 4, 5, 7
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = advantage_estimator(r.advantage)(rewards, [0, 0, 1, 1], scale=r.adv_scale)
    logits = torch.randn(b, t, v, generator=gen, requires_grad=True)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = logp.detach() + 0.01 * torch.randn(b, t, generator=gen)
    mask = torch.ones(b, t)
    mask[1, 3:] = 0
    cfg: dict = {"clip_low": r.clip_low, "clip_high": r.clip_high}
    if r.policy_loss == "ppo_clip":
        cfg["clip_dual"] = r.clip_dual
    loss_mat, metrics = policy_loss(r.policy_loss, logp, old, adv, mask, **cfg)
    total = aggregate(loss_mat, mask, r.loss_agg)
    if r.kl_coef:
        ref_logp = logp.detach() - 0.05
        total = total + r.kl_coef * aggregate(kl_penalty(logp, ref_logp, r.kl_kind), mask, r.loss_agg)
    if r.js_coef:
        ref_logits = logits.detach() + 0.1 * torch.randn(b, t, v, generator=gen)
        total = total + r.js_coef * aggregate(js_divergence(logits, ref_logits), mask, r.loss_agg)
    total.backward()
    assert torch.isfinite(total)
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert all(isinstance(x, float) for x in metrics.values())
