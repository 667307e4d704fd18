"""``plugins.dpo``: pairs formed from each group's own rollouts, the trainer's DPO gradient equal to autograd of
``meshrl.algos.preference.dpo_loss`` on the same pairs (micro-batches splitting the pairs), the one-process
update path, end-to-end runs on the tiny model, and bad settings named by key."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algos import dpo_loss
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.plugins.dpo import DpoConfig, dpo_row_weights, form_pairs
from meshrl.trainer.update import StepPlan

TINY = list(TINY_RUN)
# four groups of four: mixed, all correct (no pair), mixed, all wrong (no pair)
SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def _cfg(*extra: str, steps: int = 2):
    return load_config(overrides=[*TINY, f"steps={steps}", *extra])


def test_pairs_are_correct_by_wrong_within_a_group_and_prompt():
    groups = [0, 0, 0, 0, 1, 1, 2, 2, 2]
    prompts = [[1]] * 4 + [[2]] * 2 + [[3], [3], [4]]  # group 2: row 8 has another prompt (a Mesh prefix)
    scores = [1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    rewards = torch.tensor([0.9, 0.1, 0.3, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    pairs, n_groups = form_pairs(groups, prompts, scores, rewards, "all")
    assert pairs == [(0, 1), (0, 2), (3, 1), (3, 2), (6, 7)] and n_groups == 2  # 0.5 is not correct
    pairs, n_groups = form_pairs(groups, prompts, scores, rewards, "best_worst")
    assert pairs == [(3, 1), (6, 7)] and n_groups == 2  # best reward 1.0 (row 3) vs worst 0.1 (row 1)
    assert form_pairs([0, 0], [[1], [1]], [1.0, 1.0], None, "all") == ([], 0)
    with pytest.raises(ValueError, match=r"plugins\.dpo\.pairs"):
        form_pairs([0], [[1]], [1.0], None, "random")


def test_row_weights_are_the_gradient_of_the_mean_pair_loss():
    g = torch.Generator().manual_seed(0)
    seq, ref = (-5 * torch.rand(6, generator=g, dtype=torch.float64) for _ in range(2))
    pairs = [(0, 1), (0, 2), (3, 4), (5, 4)]
    cfg = DpoConfig(enabled=True, beta=0.3, coef=2.0, loss_type="sigmoid", label_smoothing=0.1)
    w, stats = dpo_row_weights(cfg, pairs, seq, ref)
    # by hand: dL/d delta for the cDPO loss, spread +/- onto the chosen / rejected rows
    want = torch.zeros(6, dtype=torch.float64)
    for c, r in pairs:
        z = 0.3 * ((seq[c] - ref[c]) - (seq[r] - ref[r]))
        dl = -0.3 * (0.9 * torch.sigmoid(-z) - 0.1 * torch.sigmoid(z))
        want[c] += 2.0 * dl / len(pairs)
        want[r] -= 2.0 * dl / len(pairs)
    torch.testing.assert_close(w, want)
    assert stats["dpo/pairs"] == 4 and 0 <= stats["dpo/accuracy"] <= 1
    empty_w, empty = dpo_row_weights(cfg, [], seq, ref)
    assert empty == {"dpo/pairs": 0.0, "dpo/groups": 0.0} and not empty_w.any()


def _seq_logps_with_grad(t: Trainer, model, data) -> torch.Tensor:
    out = [None] * len(data)
    for idx, mb in t.forward.micro_batches(list(range(len(data))), data):
        lp = token_logprobs(t.forward.logits(model, mb), mb.response_ids, t.cfg.rollout.temperature)
        for k, j in enumerate(idx):
            out[j] = (lp[k] * mb.response_mask[k]).sum()
    return torch.stack(out)


@pytest.mark.parametrize(("pairs", "loss_type"), [("all", "sigmoid"), ("best_worst", "hinge")])
def test_trainer_dpo_gradient_equals_autograd_of_dpo_loss(tmp_path, pairs, loss_type):
    """Exact case (one optimiser step per batch), micro-batches of 3 rows splitting the pairs; advantages 0
    so the recipe's own term has no gradient and the update's gradient is the DPO contribution alone."""
    t = Trainer(_cfg("plugins.dpo.enabled=true", f"plugins.dpo.pairs={pairs}", f"plugins.dpo.loss_type={loss_type}",
                     "plugins.dpo.coef=0.7", "plugins.dpo.beta=0.5", "train.micro_batch_size=3",
                     "optim.max_grad_norm=1e9", "train.update_workers=1"), tmp_path / "t")
    try:
        assert t.ref_model is not None  # loaded for the plug-in though grpo has no KL
        assert t.plugins.active and t.engine.serial(StepPlan(), 0)
        with torch.no_grad():  # a reference that differs from the policy: delta != 0
            for p in t.ref_model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        data, _ = t.sampler.run(0, 0)
        assert len(data) == len(SCORES)
        data.scores = list(SCORES)
        data.rewards = torch.tensor(SCORES) + 0.01 * torch.arange(len(SCORES))  # distinct best / worst
        data.advantages = torch.zeros(len(data))
        params = [p for p in t.model.parameters() if p.requires_grad]
        seq = _seq_logps_with_grad(t, t.model, data)
        with torch.no_grad():
            ref = _seq_logps_with_grad(t, t.ref_model, data)
        chosen, rejected = map(list, zip(*form_pairs(data.group_ids, data.prompt_ids, SCORES, data.rewards,
                                                     pairs)[0], strict=True))
        losses, _ = dpo_loss(seq[chosen], seq[rejected], ref[chosen], ref[rejected], beta=0.5, loss_type=loss_type)
        want = torch.autograd.grad(0.7 * losses.mean(), params, allow_unused=True)
        for g in t.optimizer.param_groups:
            g["lr"] = 0.0
        stats = t.update(data)
        for p, w in zip(params, want, strict=True):
            torch.testing.assert_close(p.grad, torch.zeros_like(p) if w is None else w, rtol=1e-4, atol=1e-7)
        assert stats["dpo/pairs"] == len(chosen) == (7 if pairs == "all" else 2)  # 2x2 + 1x3 pairs, or 1 + 1
        assert stats["dpo/groups"] == 2
        # float32 sequence log-probs, batched differently: equal to ~1e-5
        assert stats["dpo/loss"] == pytest.approx(float(losses.detach().mean()), rel=1e-4)
        assert stats["loss/total"] == pytest.approx(stats["loss/policy"] + 0.7 * stats["dpo/loss"], rel=1e-5)
    finally:
        t.close()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["recipe=grpo"],
    ["recipe=mesh", "rollout.prompts_per_step=2", "mesh.m=2", "mesh.mu=0.1", "plugins.dpo.pairs=best_worst"],
    ["recipe=gspo", "train.ppo_epochs=2"],  # a sequence-level loss is fine: DPO is sequence-level too
])
def test_dpo_trains_on_tiny_and_logs_its_metrics(tmp_path, monkeypatch, extra):
    from meshrl.tasks.tiny import RepeatTask

    # the untrained tiny model never solves a problem: a score by the text's characters gives mixed groups
    monkeypatch.setattr(RepeatTask, "score", lambda self, completion, problem: float(sum(map(ord, completion)) % 2))
    hist = train(_cfg(*extra, "plugins.dpo.enabled=true", steps=2), tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2]
    assert any(m["dpo/pairs"] > 0 for m in hist)
    for m in hist:
        assert math.isfinite(m["loss/total"]) and math.isfinite(m["grad/norm"])
        if m["dpo/pairs"] > 0:
            assert m["dpo/loss"] > 0 and 0 <= m["dpo/accuracy"] <= 1 and math.isfinite(m["dpo/reward_margin"])
            assert m["dpo/groups"] >= 1
        else:
            assert "dpo/loss" not in m


def test_repeated_updates_on_one_batch_open_the_margin(tmp_path):
    """The term optimises what it says: at the start the policy is the reference (margin 0); after two
    updates on the same pairs the implicit-reward margin is positive and more pairs are ranked right."""
    t = Trainer(_cfg("plugins.dpo.enabled=true", "plugins.dpo.beta=1.0", "optim.lr=1e-2", "train.update_workers=1",
                     "train.ppo_epochs=2"), tmp_path / "t")
    try:
        data, _ = t.sampler.run(0, 0)
        data.scores = list(SCORES)
        data.advantages = torch.zeros(len(data))  # the DPO term alone moves the policy
        first = t.update(data)
        assert first["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)
        t.update(data)
        last = t.update(data)
        assert last["dpo/reward_margin"] > 0.01 and last["dpo/accuracy"] > 0.5
        assert last["dpo/loss"] < first["dpo/loss"]
    finally:
        t.close()


def test_no_pairs_step_adds_nothing(tmp_path, monkeypatch):
    """Groups all wrong (the untrained model): no pair, ``dpo/pairs`` 0, and the update is plain GRPO's."""
    t = Trainer(_cfg("plugins.dpo.enabled=true", "train.update_workers=1"), tmp_path / "t")
    try:
        data, _ = t.sampler.run(0, 0)
        data.scores = [0.0] * len(data)
        stats = t.update(data)
        assert stats["dpo/pairs"] == 0 and "dpo/loss" not in stats and t.plugins.get("dpo").weights is None
    finally:
        t.close()


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.dpo.beta=0", "plugins.dpo.beta"),
    ("plugins.dpo.coef=-1", "plugins.dpo.coef"),
    ("plugins.dpo.pairs=random", "plugins.dpo.pairs"),
    ("plugins.dpo.loss_type=ipo", "plugins.dpo.loss_type"),
    ("plugins.dpo.label_smoothing=0.5", "plugins.dpo.label_smoothing"),
    ("plugins.dpo.loss_type=hinge,plugins.dpo.label_smoothing=0.1", "plugins.dpo.label_smoothing"),
    ("plugins.dpo.typo=1", "plugins.dpo.typo"),
])
def test_bad_dpo_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=["plugins.dpo.enabled=true", *override.split(",")])
