"""``plugins.implicit_value`` (VIMPO): the implied advantages against a double loop, the whitening against
``torch.std``, the trainer's gradient against autograd of the value loss plus the actor's policy loss computed
from scratch, bad settings named by key, and a two-step run on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algos import aggregate, ppo_clip_loss
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.plugins.implicit_value import centred_rewards, implied_advantages, masked_whiten
from meshrl.trainer.update import StepPlan


def _cfg(*extra: str, steps: int = 2):
    return load_config(overrides=[*TINY_RUN, f"steps={steps}", *extra])


def test_implied_advantages_equal_a_double_loop():
    g = torch.Generator().manual_seed(0)
    tau = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    for lam in (1.0, 0.7, 0.0):
        got = implied_advantages(tau * mask, mask, lam)
        for i in range(3):
            length = int(mask[i].sum())
            for t in range(6):
                want = sum(lam ** (k - t) * float(tau[i, k]) for k in range(t, length)) if t < length else 0.0
                assert float(got[i, t]) == pytest.approx(want, abs=1e-12)


def test_masked_whiten_and_centred_rewards():
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    valid = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    want = (valid - valid.mean()) / torch.sqrt(valid.std() ** 2 + 1e-8)  # torch.std is unbiased
    got = masked_whiten(x, mask)
    torch.testing.assert_close(got[mask > 0], want)
    assert float(got[0, 2]) == 0 and float(got[1, 1]) == 0
    assert masked_whiten(x, torch.zeros_like(mask)).abs().sum() == 0
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    assert centred_rewards(r, ["a", "a", "b", "b", "a"]).tolist() == pytest.approx([1 / 3, -2 / 3, -0.5, 0.5, 1 / 3])


def test_trainer_gradient_is_the_value_loss_plus_the_actor_loss(tmp_path):
    """One micro-batch holding the whole batch, one optimiser step: the update's gradient equals autograd of
    ``value_coef * 1/2 mean_i (beta sum_t (log pi - log ref - sg KL) - (R - mean_group R))^2`` plus ``actor_coef``
    times GRPO's on-policy clip loss with the whitened implied advantages, all computed here from scratch."""
    beta, c_a, c_v = 0.3, 0.05, 0.7
    t = Trainer(_cfg("plugins.implicit_value.enabled=true", f"plugins.implicit_value.beta={beta}",
                     f"plugins.implicit_value.actor_coef={c_a}", f"plugins.implicit_value.value_coef={c_v}",
                     "plugins.implicit_value.lam=0.9", "optim.max_grad_norm=1e9", "train.update_workers=1"),
                tmp_path / "t")
    try:
        assert t.ref_model is not None and t.plugins.active and t.engine.serial(StepPlan(), 0)
        with torch.no_grad():  # a reference that differs from the policy
            for p in t.ref_model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        data, _ = t.sampler.run(0, 0)
        data.scores = [float(i % 3 == 0) for i in range(len(data))]
        data.rewards = torch.tensor(data.scores)
        ((idx, mb),) = list(t.forward.micro_batches(list(range(len(data))), data))
        params = [p for p in t.model.parameters() if p.requires_grad]
        logits = t.forward.logits(t.model, mb)
        logp = token_logprobs(logits, mb.response_ids, 1.0)
        mask = mb.response_mask
        with torch.no_grad():
            ref_logits = t.forward.logits(t.ref_model, mb)
            ref = token_logprobs(ref_logits, mb.response_ids, 1.0)
            p_all, r_all = torch.softmax(logits, -1), torch.softmax(ref_logits, -1)
            kl = (p_all * (p_all.log() - r_all.log())).sum(-1)
        value = torch.zeros(())
        for k, j in enumerate(idx):
            group = [i for i in range(len(data)) if data.group_ids[i] == data.group_ids[j]]
            target = data.scores[j] - sum(data.scores[i] for i in group) / len(group)
            s = beta * ((logp[k] - ref[k] - kl[k]) * mask[k]).sum()
            value = value + 0.5 * (s - target) ** 2 / len(idx)
        tau = (beta * (logp.detach() - ref - kl) * mask).double()
        raw = torch.zeros_like(tau)
        for k in range(tau.shape[0]):
            length = int(mask[k].sum())
            for pos in range(length):
                raw[k, pos] = sum(0.9 ** (q - pos) * float(tau[k, q]) for q in range(pos, length))
        valid = raw[mask > 0]
        adv = ((raw - valid.mean()) / torch.sqrt(valid.var() + 1e-8) * mask).float()
        pg, _ = ppo_clip_loss(logp, logp.detach(), c_a * adv, mask)
        actor = aggregate(pg, mask, "seq-mean-token-mean")
        want = torch.autograd.grad(c_v * value + actor, params, allow_unused=True)
        for g in t.optimizer.param_groups:
            g["lr"] = 0.0
        stats = t.update(data)
        for p, w in zip(params, want, strict=True):
            torch.testing.assert_close(p.grad, torch.zeros_like(p) if w is None else w, rtol=1e-4, atol=1e-7)
        assert stats["implicit_value/value_loss"] == pytest.approx(float(value.detach()), rel=1e-4)
        assert stats["implicit_value/kl_mean"] == pytest.approx(float(kl[mask > 0].mean()), rel=1e-4)
    finally:
        t.close()


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.implicit_value.beta=0", "plugins.implicit_value.beta"),
    ("plugins.implicit_value.actor_coef=-1", "plugins.implicit_value.actor_coef"),
    ("plugins.implicit_value.value_coef=0", "plugins.implicit_value.value_coef"),
    ("plugins.implicit_value.lam=1.5", "plugins.implicit_value.lam"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_a_second_kl_path_is_refused():
    with pytest.raises(ValueError, match=r"plugins\.implicit_value\.enabled needs algo\.kl_coef=0"):
        load_config(overrides=["plugins.implicit_value.enabled=true", "algo.kl_coef=0.01"])


def test_trains_two_steps_on_tiny(tmp_path):
    hist = train(_cfg("plugins.implicit_value.enabled=true"), tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2]
    for m in hist:
        for key in ("implicit_value/value_loss", "implicit_value/kl_mean", "implicit_value/adv_raw_abs_mean",
                    "loss/total", "grad/norm"):
            assert key in m and math.isfinite(m[key]), key
        assert m["implicit_value/kl_mean"] >= -1e-6  # step 1: the policy is the reference, KL 0 up to rounding


@pytest.mark.parametrize("extra", [
    ["recipe=mesh", "rollout.prompts_per_step=2", "mesh.m=2", "mesh.mu=0.1"],
    ["recipe=dapo", "algo.dynamic_sampling=false", "train.ppo_epochs=2", "train.mini_batches=2"],
])
def test_composes_with_mesh_and_several_optimiser_steps(tmp_path, extra):
    hist = train(_cfg(*extra, "plugins.implicit_value.enabled=true"), tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2]
    assert all(math.isfinite(m["implicit_value/value_loss"]) and math.isfinite(m["grad/norm"]) for m in hist)


def test_entropy_advantage_is_refused_beside_it():
    """entropy_adv's absolute bonus would dwarf VIMPO's advantages, which actor_coef scales by 5e-3."""
    from meshrl.trainer import load_config

    with pytest.raises(ValueError, match="plugins.implicit_value.enabled and plugins.entropy_adv.enabled exclude"):
        load_config(overrides=["plugins.implicit_value.enabled=true", "plugins.entropy_adv.enabled=true"])
