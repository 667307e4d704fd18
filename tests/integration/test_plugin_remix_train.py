"""``plugins.remix`` (ReMix, Liang et al. 2025) in the trainer: the lambda schedule, historical rows scored against
the policy that sampled them, the KL-Convex term against its formula, reincarnation, resume refused, and training on
the tiny model (the mix-policy PPG loss and the settings: tests/unit/test_plugin_remix.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from meshrl.algos import aggregate, ppo_clip_loss
from meshrl.testing import tiny_config
from meshrl.trainer import Trainer, train
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.loss import UpdateInputs
from meshrl.trainer.plugins.remix import Remix


def test_lambda_follows_the_papers_schedule(tmp_path):
    plugin = _trainer(tmp_path).plugins.get("remix")
    # max(1 - 0.1 ceil(max(t - 50, 0) / 10), 0.5)
    for t, want in [(1, 1.0), (50, 1.0), (51, 0.9), (60, 0.9), (61, 0.8), (90, 0.6), (91, 0.5), (100, 0.5),
                    (500, 0.5)]:
        assert plugin.lam(t) == pytest.approx(want), t


def _trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer(tiny_config("plugins.remix.enabled=true", "train.update_workers=1", *extra), tmp_path / "run")


def _step(t: Trainer, step: int, cursor: int):
    data, cursor = t.plugins.sample(t.sampler, step, cursor)
    return data, cursor


def test_historical_rows_are_whole_groups_against_their_sampling_policy(tmp_path):
    t = _trainer(tmp_path, "plugins.remix.off_policy_frac=0.5")
    plugin: Remix = t.plugins.get("remix")
    d0, cur = _step(t, 0, 0)
    assert d0.stats["remix/hist_rows"] == 0
    t.step_idx = 0
    t.update(d0)  # stores step 0's rows with their pi_0 log-probs, then moves the policy
    d1, _ = _step(t, 1, cur)
    n = plugin.n_fresh
    assert d1.stats["remix/hist_rows"] == len(d1) - n == n  # p / (1 - p) = 1: as many historical rows as fresh
    hist = list(range(n, len(d1)))
    old_texts = dict(zip(d0.texts, d0.group_ids, strict=True))
    groups = {old_texts[d1.texts[i]] for i in hist}
    for g in groups:  # whole groups of step 0, with step 0's advantages
        rows0 = [i for i, x in enumerate(d0.group_ids) if x == g]
        rows1 = [i for i in hist if d1.group_ids[i] == g]
        assert len(rows0) == len(rows1)
        torch.testing.assert_close(d1.advantages[rows1], d0.advantages[rows0])
    # behaviour of the historical rows: pi_0, i.e. the still-initial pi_base's log-probs
    behaviour = plugin.behaviour_logps(d1, None)
    base = t.forward.logps(plugin.base, d1)
    for i in hist:
        torch.testing.assert_close(behaviour[i], base[i])
    now = t.forward.logps(t.model, d1)
    assert any(not torch.allclose(behaviour[i], now[i]) for i in hist)  # the policy moved: a real off-policy ratio
    for i in range(n):
        torch.testing.assert_close(behaviour[i], now[i])
    # the update's loss on the historical micro-batch: mix-policy PPG, centre pi_k / pi_0
    idx, mb = list(t.forward.micro_batches(list(range(len(d1))), d1))[-1]
    assert set(idx) <= set(hist)
    plugin.begin_update(d1, None, None)
    r = t.objective.micro_loss(idx, mb, UpdateInputs(d1, behaviour, None, 1))
    with torch.no_grad():
        logp = token_logprobs(t.forward.logits(t.model, mb), mb.response_ids, 1.0)
    pad = lambda rows: torch.stack([torch.nn.functional.pad(x, (0, logp.shape[1] - len(x))) for x in rows])  # noqa: E731
    b, s = pad([behaviour[j] for j in idx]), pad([now[j] for j in idx])
    mat = torch.empty_like(logp)
    for i, j in enumerate(idx):
        for k in range(logp.shape[1]):
            ratio, c, a = math.exp(logp[i, k] - b[i, k]), math.exp(s[i, k] - b[i, k]), float(d1.advantages[j])
            mat[i, k] = -min(ratio * a, min(max(ratio, c - 0.2), c + 0.2) * a)
    want = aggregate(mat, mb.response_mask, "seq-mean-token-mean")
    assert r.stats["loss/policy"] == pytest.approx(float(want), rel=1e-4, abs=1e-7)
    assert r.stats["remix/off_tokens"] > 0


def test_klc_term_equals_its_formula(tmp_path):
    t = _trainer(tmp_path, "plugins.remix.beta=0.5", "plugins.remix.lambda_max=0.7", "plugins.remix.off_policy_frac=0")
    plugin: Remix = t.plugins.get("remix")
    cur = 0
    for step in range(2):  # two updates: at step 2, pi_base = pi_0 and pi_{k-1} = pi_1 differ
        data, cur = _step(t, step, cur)
        t.step_idx = step
        t.update(data)
    data, _ = _step(t, 2, cur)
    assert plugin.behaviour_logps(data, None) is None and plugin.start is None  # on-policy: the update's pi_old
    old = t.forward.logps(t.model, data)
    pi_1 = copy.deepcopy(plugin.prev)
    assert plugin.begin_update(data, None, None)["remix/lambda"] == 0.7
    with torch.no_grad():  # move the policy off pi_2 so that the ratio and both KLs are non-trivial
        for p in t.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    idx, mb = next(iter(t.forward.micro_batches(list(range(len(data))), data)))
    r = t.objective.micro_loss(idx, mb, UpdateInputs(data, old, None, 2))
    with torch.no_grad():
        logp = token_logprobs(t.forward.logits(t.model, mb), mb.response_ids, 1.0)
        base = token_logprobs(t.forward.logits(plugin.base, mb), mb.response_ids, 1.0)
        prev = token_logprobs(t.forward.logits(pi_1, mb), mb.response_ids, 1.0)
    assert not torch.allclose(base, prev)
    mask = mb.response_mask
    k3 = lambda ref: torch.exp(ref - logp) - (ref - logp) - 1  # noqa: E731  (KL(pi_theta || ref), k3)
    old_mat = torch.stack([torch.nn.functional.pad(old[j], (0, logp.shape[1] - len(old[j]))) for j in idx])
    pg, _ = ppo_clip_loss(logp, old_mat, data.advantages[idx], mask)
    want_pg = aggregate(pg, mask, "seq-mean-token-mean")
    want_klc = aggregate(0.7 * k3(base) + 0.3 * k3(prev), mask, "seq-mean-token-mean")
    assert r.stats["remix/klc"] == pytest.approx(float(want_klc), rel=1e-4)
    assert float(r.loss.detach()) == pytest.approx(float(want_pg + 0.5 * want_klc), rel=1e-4)


def test_reincarnation_resets_the_base_and_stops_mixing(tmp_path):
    hist = train(tiny_config("plugins.remix.enabled=true", "plugins.remix.reincarnate_at=2",
                             "plugins.remix.lambda_max=0.5", "steps=4"), tmp_path / "run")
    assert [m["remix/reincarnated"] for m in hist] == [0.0, 0.0, 1.0, 1.0]
    assert hist[1]["remix/hist_rows"] > 0 and hist[2]["remix/hist_rows"] == hist[3]["remix/hist_rows"] == 0
    t = _trainer(tmp_path / "b", "plugins.remix.reincarnate_at=1")
    plugin: Remix = t.plugins.get("remix")
    d0, cur = _step(t, 0, 0)
    t.update(d0)
    _step(t, 1, cur)
    for a, b in zip(plugin.base.parameters(), t.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # pi_base <- pi_T
    assert not plugin.history


def test_resume_is_refused(tmp_path):
    over = ["plugins.remix.enabled=true", "checkpoint.every=1"]
    train(tiny_config(*over, steps=1), tmp_path / "run")
    with pytest.raises(ValueError, match=r"plugins\.remix: a run cannot be resumed"):
        train(tiny_config(*over, steps=2), tmp_path / "run", resume=True)


@pytest.mark.parametrize("recipe", [("recipe=grpo",), ("recipe=dapo", "algo.dynamic_sampling=false"),
                                    ("recipe=mesh", "rollout.prompts_per_step=2", "mesh.m=2", "mesh.mu=0.1")])
def test_trains_on_tiny(tmp_path, recipe):
    hist = train(tiny_config(*recipe, "plugins.remix.enabled=true", "train.mini_batches=2", steps=3),
                 tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2, 3]
    assert hist[0]["remix/hist_rows"] == 0 and hist[2]["remix/hist_rows"] > 0
    for m in hist:
        assert math.isfinite(m["loss/total"]) and math.isfinite(m["grad/norm"]) and m["remix/lambda"] == 1.0
