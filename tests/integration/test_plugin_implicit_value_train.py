"""``plugins.implicit_value`` (VIMPO) in the trainer: the trainer's gradient against autograd of the value loss plus
the actor's policy loss computed from scratch, and runs on the tiny model (the implied advantages, the whitening and
the settings: tests/unit/test_plugin_implicit_value.py)."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algos import aggregate, ppo_clip_loss
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.update import StepPlan


def _cfg(*extra: str, steps: int = 2):
    return load_config(overrides=[*TINY_RUN, f"steps={steps}", *extra])


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
