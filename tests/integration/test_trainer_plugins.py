"""The ``plugins.*`` terms in the trainer: each runs end to end on the tiny model (with GRPO, DAPO, CISPO and
Mesh), logs its metric, refuses bad settings by key, and turns off the worker split and the zero-advantage
shortcut while staying equal to the plain update where its formula says so."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from meshrl.algos import (
    aggregate,
    group_advantages,
    high_entropy_mask,
    luffy_off_policy_loss,
    ppo_clip_loss,
    topk_forward_kl,
)
from meshrl.forkpool import fork_available
from meshrl.jsonl import read_jsonl
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.batch import token_entropy, token_logprobs
from meshrl.trainer.loss import UpdateInputs
from meshrl.trainer.plugins import PluginContext, PluginsConfig, TokenTerms, TrainPlugins
from meshrl.trainer.plugins.fork import untrained_shares
from meshrl.trainer.plugins.luffy import load_traces
from meshrl.trainer.update import StepPlan

TINY = list(TINY_RUN)
PLUGIN_METRIC = {
    "clip_cov": "clipcov/frac_tokens", "kl_cov": "klcov/penalty", "entropy_adv": "entadv/bonus_mean",
    "fork": "fork/frac_tokens", "m2po": "m2po/masked_frac",
}  # luffy needs a traces file: its own tests below


def _cfg(*extra: str, steps: int = 2):
    return load_config(overrides=[*TINY, f"steps={steps}", *extra])


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    return Trainer(_cfg(*extra), tmp_path / name)


@pytest.mark.slow
@pytest.mark.parametrize(("plugin", "extra"), [
    ("clip_cov", ["recipe=dapo", "algo.dynamic_sampling=false", "plugins.clip_cov.ratio=0.05"]),
    ("kl_cov", ["recipe=grpo", "train.ppo_epochs=2", "train.mini_batches=2"]),
    ("entropy_adv", ["recipe=grpo", "algo.policy_loss=cispo"]),
    ("fork", ["recipe=mesh", "rollout.prompts_per_step=2", "mesh.m=2", "mesh.mu=0.1"]),
    ("m2po", ["recipe=grpo", "train.ppo_epochs=2", "train.mini_batches=2"]),
])
def test_each_plugin_trains_and_logs_its_metric(tmp_path, plugin, extra):
    hist = train(_cfg(*extra, f"plugins.{plugin}.enabled=true"), tmp_path / plugin)
    assert [m["step"] for m in hist] == [1, 2]
    key = PLUGIN_METRIC[plugin]
    for m in hist:
        assert key in m and math.isfinite(m[key]), key
        assert math.isfinite(m["loss/total"]) and math.isfinite(m["grad/norm"])
    if plugin == "fork":
        assert 0 < hist[0][key] <= 1 and "mesh/balance_loss" in hist[-1]
    if plugin == "kl_cov":  # several optimiser steps per batch: the penalised tokens moved off-policy
        assert any(m[key] > 0 for m in hist)
    assert "plugins:" in (tmp_path / plugin / "config.yaml").read_text()


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.clip_cov.ratio=0", "plugins.clip_cov.ratio"),
    ("plugins.clip_cov.cov_ub=0.5", "plugins.clip_cov.cov_ub"),
    ("plugins.kl_cov.coef=-1", "plugins.kl_cov.coef"),
    ("plugins.entropy_adv.kappa=1", "plugins.entropy_adv.kappa"),
    ("plugins.fork.top_frac=1.5", "plugins.fork.top_frac"),
    ("plugins.fork.norm=tokens", "plugins.fork.norm"),
    ("plugins.m2po.threshold=0", "plugins.m2po.threshold"),
    ("plugins.fork.typo=1", "plugins.fork.typo"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_incompatible_plugins_and_sequence_losses_are_refused():
    with pytest.raises(ValueError, match=r"plugins\.clip_cov\.enabled and plugins\.kl_cov\.enabled"):
        load_config(overrides=["plugins.clip_cov.enabled=true", "plugins.kl_cov.enabled=true"])
    with pytest.raises(ValueError, match=r"plugins\.entropy_adv\.enabled needs a token-level policy loss.*gspo"):
        load_config(overrides=["recipe=gspo", "plugins.entropy_adv.enabled=true"])


def _some_zero_advantages(data, seed: int) -> None:
    data.advantages = torch.randn(len(data), generator=torch.Generator().manual_seed(seed))
    data.advantages[:4] = 0.0  # one whole group


@pytest.mark.parametrize("plugin", [*sorted(PLUGIN_METRIC), "luffy", "distill"])
def test_plugins_turn_off_workers_and_skipping_and_match_one_plain_process(tmp_path, plugin):
    on = [f"plugins.{plugin}.enabled=true"]
    if plugin == "luffy":
        from meshrl.tasks import load_task

        on.append(f"plugins.luffy.traces={_traces(tmp_path, load_task('tiny:repeat', seed=0).problems('train'))}")
    if plugin == "distill":
        on += ["plugins.distill.teacher=tiny", "plugins.distill.teacher_seed=1"]
    workers = 2 if fork_available() else 1
    plain = _trainer(tmp_path, "plain", *on, "train.update_workers=1", "train.skip_zero_advantage=false")
    fast = _trainer(tmp_path, "fast", *on, f"train.update_workers={workers}")
    try:
        assert fast.plugins.active and fast.engine.serial(StepPlan(), 0)
        data, _ = plain.sampler.run(0, 0)
        luffy = plain.plugins.get("luffy")
        if luffy is not None:
            data = luffy.after_sampling(0, data, plain.sampler)
        _some_zero_advantages(data, 0)
        m_plain, m_fast = plain.update(data), fast.update(data)
        metric = PLUGIN_METRIC.get(plugin, {"luffy": "offpolicy/frac_tokens", "distill": "distill/loss"}.get(plugin))
        assert set(m_plain) == set(m_fast) and metric in m_fast
        rel = 1e-5 if fast.engine.freeze_zero else 1e-6  # the frozen rows' shortcut: equal up to rounding
        for k, v in m_plain.items():
            assert m_fast[k] == pytest.approx(v, rel=rel, abs=1e-7 if fast.engine.freeze_zero else 1e-9), k
        # a plug-in whose terms vanish with the advantage keeps the shortcut in one process (equal up to rounding:
        # the other rows' forward runs in a smaller batch); any other one computes exactly what one process does
        assert fast.engine.freeze_zero == type(fast.plugins.get(plugin)).zero_advantage_exact
        for p, q in zip(plain.model.parameters(), fast.model.parameters(), strict=True):
            torch.testing.assert_close(q, p, **({} if fast.engine.freeze_zero else {"rtol": 0, "atol": 0}))
    finally:
        plain.close()
        fast.close()
    # and without the plug-in the shortcut is back
    assert _trainer(tmp_path, "g", "train.update_workers=1").engine.skip_zero


def _update_grads(trainer: Trainer, data) -> list[torch.Tensor]:
    """Gradient of one single-pass update (taken before the optimiser step by a zero learning rate)."""
    for g in trainer.optimizer.param_groups:
        g["lr"] = 0.0
    trainer.cfg.optim.lr = 0.0
    trainer.update(data)
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in trainer.model.parameters()]


@pytest.mark.parametrize("plugin", ["kl_cov", "m2po"])
def test_on_policy_kl_cov_and_m2po_equal_plain_grpo(tmp_path, plugin):
    # One optimiser step per batch: r = 1, so KL-Cov's penalty, M2PO's mask and the dropped clip change nothing.
    plain = _trainer(tmp_path, "plain", "train.update_workers=1", "train.skip_zero_advantage=false")
    plug = _trainer(tmp_path, "plug", f"plugins.{plugin}.enabled=true", "train.update_workers=1")
    data, _ = plain.sampler.run(0, 0)
    _some_zero_advantages(data, 1)
    for a, b in zip(_update_grads(plain, data), _update_grads(plug, data), strict=True):
        torch.testing.assert_close(b, a)


def test_clip_cov_with_every_token_a_candidate_removes_the_whole_gradient(tmp_path):
    # On-policy nothing is clipped, so with ratio 1 and an unbounded band every valid token is detached.
    t = _trainer(tmp_path, "cc", "plugins.clip_cov.enabled=true", "plugins.clip_cov.ratio=1.0",
                 "plugins.clip_cov.cov_lb=-1e9", "plugins.clip_cov.cov_ub=1e9", "train.update_workers=1")
    data, _ = t.sampler.run(0, 0)
    _some_zero_advantages(data, 2)
    m = t.update(data)
    assert m["grad/norm"] == 0.0 and m["clipcov/frac_tokens"] == pytest.approx(1.0)


def test_fork_and_entropy_adv_micro_batch_loss_equals_the_formula(tmp_path):
    t = _trainer(tmp_path, "f", "plugins.fork.enabled=true", "plugins.fork.top_frac=0.3",
                 "plugins.entropy_adv.enabled=true", "plugins.entropy_adv.alpha=0.4", "train.update_workers=1")
    data, _ = t.sampler.run(0, 0)
    _some_zero_advantages(data, 3)
    rows = list(range(len(data)))
    (idx, mb), = list(t.forward.micro_batches(rows, data))
    r = t.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))
    loss, stats = r.loss, r.stats
    with torch.no_grad():
        logits = t.forward.logits(t.model, mb)
        logp = token_logprobs(logits, mb.response_ids, 1.0)
        h = token_entropy(logits, 1.0)
    mask = mb.response_mask
    adv = data.advantages[idx][:, None].expand_as(logp)
    shaped = adv + torch.minimum(0.4 * h, adv.abs() / 2.0)
    keep = high_entropy_mask(h, mask, top_frac=0.3).to(logp.dtype)
    pg, _ = ppo_clip_loss(logp, logp, shaped, mask)
    want = aggregate(pg * keep, keep, "seq-mean-token-mean")  # grpo's aggregation over the kept tokens
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    assert stats["fork/frac_tokens"] == pytest.approx(float(keep.sum() / mask.sum()))
    assert stats["entadv/bonus_mean"] > 0
    rows = mask.sum(-1) > 0
    unkept = rows & ((keep * mask).sum(-1) == 0)
    pos = rows & ((shaped * mask).sum(-1) > 0)
    n = int(rows.sum())
    assert stats["fork/rows_unkept"] == pytest.approx(float(unkept.sum()) / n)
    assert stats["fork/rows_adv_pos"] == pytest.approx(float(pos.sum()) / n)
    assert stats["fork/rows_unkept_adv_pos"] == pytest.approx(float((unkept & pos).sum()) / n)
    assert stats["fork/first_kept"] == pytest.approx(float(keep[rows, 0].sum()) / n)  # responses start at column 0


def test_fork_untrained_shares_on_a_hand_made_case():
    # Row 0: first token kept, A > 0. Row 1: nothing kept, A > 0. Row 2: nothing kept, A < 0, its valid tokens
    # start late (left padding). Row 3: no response token at all (left out of every share).
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 1, 1], [0, 0, 0]], dtype=torch.float32)
    keep = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)  # outside the mask: ignored
    adv = torch.tensor([0.5, 1.0, -2.0, 3.0])
    got = untrained_shares(keep, mask, adv)
    assert got == pytest.approx({"fork/rows_unkept": 2 / 3, "fork/rows_adv_pos": 2 / 3,
                                 "fork/rows_unkept_adv_pos": 1 / 3, "fork/first_kept": 1 / 3})
    # Row 1 sums to +3 over its valid tokens and to -6 over all: only the valid ones may decide its sign.
    per_token = adv[:, None] * torch.tensor([[1.0, 1, 1], [1, 2, -9], [1, 1, 1], [1, 1, 1]])
    assert untrained_shares(keep, mask, per_token) == pytest.approx(got)


def test_clip_cov_draw_is_seeded_by_run_seed_and_step(tmp_path):
    extra = ["plugins.clip_cov.enabled=true", "plugins.clip_cov.ratio=0.3", "plugins.clip_cov.cov_lb=-1e9",
             "plugins.clip_cov.cov_ub=1e9", "train.update_workers=1"]
    a, b = _trainer(tmp_path, "a", *extra), _trainer(tmp_path, "b", *extra)
    data, _ = a.sampler.run(0, 0)
    _some_zero_advantages(data, 4)
    grads_a, grads_b = _update_grads(a, data), _update_grads(b, data)
    for x, y in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    b.step_idx = 1  # another step draws other tokens
    assert any(not torch.equal(x, y) for x, y in zip(grads_a, _update_grads(b, data), strict=True))


def _traces(tmp_path, task_problems, completion=lambda p: p.answer) -> str:
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "completion": completion(p)}) + "\n" for p in task_problems))
    return str(path)


def test_luffy_mixes_one_trace_per_group_and_recomputes_advantages(tmp_path):
    from meshrl.tasks import load_task

    problems = load_task("tiny:repeat", seed=0).problems("train")
    path = _traces(tmp_path, problems[: len(problems) // 2])  # half the problems have a trace
    t = _trainer(tmp_path, "l", "plugins.luffy.enabled=true", f"plugins.luffy.traces={path}",
                 "rollout.prompts_per_step=8", "train.update_workers=1")
    data, _ = t.sampler.run(0, 0)
    data = t.plugins.get("luffy").after_sampling(0, data, t.sampler)
    with_trace = {p.id for p in problems[: len(problems) // 2]}
    expected_off = set()
    for g in dict.fromkeys(data.group_ids):
        rows = [i for i, x in enumerate(data.group_ids) if x == g]
        if data.problems[rows[0]].id in with_trace:
            expected_off.add(rows[-1])  # the group's last row, G - 1 stay on-policy
    assert data.rows_from("luffy") == expected_off and expected_off
    for i in expected_off:
        assert data.texts[i] == data.problems[i].answer and data.response_ids[i][-1] == t.tokenizer.eos_token_id
        assert data.scores[i] == pytest.approx(t.task.score(data.texts[i], data.problems[i]))
    torch.testing.assert_close(data.advantages, group_advantages(data.rewards, data.group_ids))
    assert data.stats["offpolicy/rows"] == len(expected_off)
    assert data.stats["offpolicy/groups_without_trace"] == 8 - len(expected_off)
    # the micro-batch loss: LUFFY's on the trace rows, the recipe's elsewhere
    idx, mb = next(iter(t.forward.micro_batches(list(range(len(data))), data)))  # the first 16 rows
    r = t.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))
    loss, stats = r.loss, r.stats
    with torch.no_grad():
        logp = token_logprobs(t.forward.logits(t.model, mb), mb.response_ids, 1.0)
    mask = mb.response_mask
    off = torch.tensor([i in expected_off for i in idx])[:, None]
    on_mat, _ = ppo_clip_loss(logp, logp, data.advantages[idx], mask)
    off_mat, _ = luffy_off_policy_loss(logp, data.advantages[idx], mask, gamma=0.1)
    want = aggregate(torch.where(off, off_mat, on_mat), mask, "seq-mean-token-mean")
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    assert stats["offpolicy/frac_tokens"] == pytest.approx(float((mask * off).sum() / mask.sum()))


def test_luffy_trains_and_refuses_bad_trace_files(tmp_path):
    from meshrl.tasks import load_task

    path = _traces(tmp_path, load_task("tiny:repeat", seed=0).problems("train"))
    hist = train(_cfg("plugins.luffy.enabled=true", f"plugins.luffy.traces={path}"), tmp_path / "run")
    assert all(m["offpolicy/rows"] == 4 and m["offpolicy/frac_tokens"] > 0 for m in hist)
    assert all(math.isfinite(m["loss/total"]) for m in hist)
    with pytest.raises(ValueError, match=r"plugins\.luffy\.traces: no such file"):
        load_config(overrides=["plugins.luffy.enabled=true", "plugins.luffy.traces=/nonexistent.jsonl"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "completion": "x"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: missing field 'completion'"):
        load_traces(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 1: not valid JSON"):
        load_traces(bad)


def test_distill_term_equals_the_formula_and_vanishes_for_the_policy_itself(tmp_path):
    t = _trainer(tmp_path, "d", "plugins.distill.enabled=true", "plugins.distill.teacher=tiny",
                 "plugins.distill.teacher_seed=1", "plugins.distill.topk=5", "plugins.distill.coef=0.5",
                 "train.update_workers=1")
    data, _ = t.sampler.run(0, 0)
    _some_zero_advantages(data, 5)
    idx, mb = next(iter(t.forward.micro_batches(list(range(len(data))), data)))
    r = t.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))
    loss, stats = r.loss, r.stats
    with torch.no_grad():
        logits = t.forward.logits(t.model, mb)
        t_logps = torch.log_softmax(t.forward.logits(t.plugins.get("distill").teacher(logits.shape[-1]), mb), -1)
        top, ids = torch.topk(t_logps, 5, dim=-1)
        mask = mb.response_mask
        pg, _ = ppo_clip_loss(token_logprobs(logits, mb.response_ids, 1.0),
                              token_logprobs(logits, mb.response_ids, 1.0), data.advantages[idx], mask)
        kl, _ = topk_forward_kl(logits, top, ids, mask)
        want = aggregate(pg, mask, "seq-mean-token-mean") + 0.5 * aggregate(kl, mask, "seq-mean-token-mean")
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    assert stats["distill/loss"] > 0 and stats["loss/total"] == pytest.approx(float(want), rel=1e-5)
    # the policy as its own teacher over the whole vocabulary: KL(p || p) = 0
    same = _trainer(tmp_path, "s", "plugins.distill.enabled=true", "plugins.distill.teacher=tiny",
                    "plugins.distill.topk=100000", "train.update_workers=1")
    s2 = same.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0)).stats
    assert s2["distill/loss"] == pytest.approx(0.0, abs=1e-5)


def test_distill_trains_and_names_its_keys(tmp_path):
    hist = train(_cfg("plugins.distill.enabled=true", "plugins.distill.teacher=tiny",
                      "plugins.distill.teacher_seed=3", "plugins.distill.topk=8"), tmp_path / "run")
    assert all(m["distill/loss"] > 0 and math.isfinite(m["loss/total"]) for m in hist)
    with pytest.raises(ValueError, match=r"plugins\.distill\.teacher="):
        load_config(overrides=["plugins.distill.enabled=true"])
    t = _trainer(tmp_path, "bad", "plugins.distill.enabled=true", "plugins.distill.teacher=/no/such/model")
    data, _ = t.sampler.run(0, 0)
    with pytest.raises(ValueError, match=r"plugins\.distill\.teacher: unknown model"):
        t.update(data)


def _random_terms(seed: int):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.randn(6, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(6, 9, generator=g) > 0.2).to(torch.float64)
    mask[2] = 0
    entropy = torch.rand(6, 9, generator=g, dtype=torch.float64) * 2
    return logp, old, adv, mask, entropy


def _context(seed: int = 0) -> PluginContext:
    """What plug-ins that act on the loss alone need: the seed (no model, task or sampler)."""
    return PluginContext(cfg=None, recipe=None, forward=None, tokenizer=None, task=None, problems=[], seed=seed,
                         rollouts=None)


def _terms(step, logp, old, adv, mask, entropy, cfg) -> TokenTerms:
    return TokenTerms(step=step, rows=list(range(logp.shape[0])), loss_name="ppo_clip", logp=logp, old=old, adv=adv,
                      mask=mask, entropy=entropy, loss_cfg=dict(cfg), batch=None)


def test_policy_term_equals_the_algos_losses():
    from meshrl.algos import clip_cov_loss, kl_cov_loss

    logp, old, adv, mask, entropy = _random_terms(0)
    cfg = {"clip_low": 0.2, "clip_high": 0.28, "clip_dual": None}
    pc = PluginsConfig()
    pc.clip_cov.enabled, pc.clip_cov.ratio = True, 0.2
    plugins = TrainPlugins(pc, _context(seed=5))
    ours, stats, agg = plugins.policy_term(_terms(3, logp, old, adv, mask, entropy, cfg))
    same_draw = TrainPlugins(pc, _context(seed=5)).get("clip_cov")._generator(3)
    want, wstats = clip_cov_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, ratio=0.2, generator=same_draw)
    torch.testing.assert_close(ours, want)
    assert stats["clipcov/n_tokens"] == wstats["clipcov/n_tokens"] >= 1 and torch.equal(agg, mask)
    pk = PluginsConfig()
    pk.kl_cov.enabled, pk.kl_cov.ratio, pk.kl_cov.coef = True, 0.1, 0.5
    ours, stats, _ = TrainPlugins(pk, _context()).policy_term(_terms(0, logp, old, adv, mask, entropy, cfg))
    want, wstats = kl_cov_loss(logp, old, adv, mask, ratio=0.1, coef=0.5)
    torch.testing.assert_close(ours, want)
    assert stats["klcov/penalty"] == pytest.approx(wstats["klcov/penalty"]) and stats["klcov/penalty"] > 0


def test_replay_reuses_each_batch_against_its_sampling_policy(tmp_path):
    hist = train(_cfg("plugins.replay.reuse_steps=2", "plugins.m2po.enabled=true", "optim.lr=1e-2", steps=4),
                 tmp_path / "r")
    assert [m["replay/age"] for m in hist] == [0.0, 1.0, 2.0, 0.0]
    assert [m["rollouts/count"] > 0 for m in hist] == [True, False, False, True]
    # single pass: at age 0 the ratio is exactly 1; a reused batch's ratio is against the policy that sampled it
    assert hist[0]["m2po/m2"] == 0.0 and hist[3]["m2po/m2"] == 0.0
    assert hist[1]["m2po/m2"] > 0 and hist[2]["m2po/m2"] > hist[1]["m2po/m2"]
    assert {row["step"] for row in read_jsonl(tmp_path / "r" / "samples.jsonl")} == {1, 2, 3, 4}
    with pytest.raises(ValueError, match=r"plugins\.replay\.reuse_steps"):
        load_config(overrides=["plugins.replay.reuse_steps=-1"])


def test_replay_batches_are_the_sampled_ones(tmp_path):
    t = _trainer(tmp_path, "t", "plugins.replay.reuse_steps=1", "train.update_workers=1")
    first, cursor = t.plugins.sample(t.sampler, 0, 0)
    again, cursor2 = t.plugins.sample(t.sampler, 1, cursor)
    assert again.texts is first.texts and cursor2 == cursor and again.stats["rollouts/count"] == 0.0
    stored = t.plugins.behaviour_logps(again, None)
    assert stored is not None and len(stored) == len(first)
    assert t.plugins.behaviour_logps(first, None) is None  # the fresh batch: the trainer's own (current policy)
    fresh, _ = t.plugins.sample(t.sampler, 2, cursor)
    assert fresh.texts is not first.texts and fresh.stats["replay/age"] == 0.0


def test_prompt_filter_skips_uniform_problems_and_readmits_them():
    from types import SimpleNamespace

    from meshrl.trainer.plugins.prompt_filter import FilteredProblems, PromptFilterConfig

    problems = [SimpleNamespace(id=f"p{i}") for i in range(4)]
    inner = SimpleNamespace(index=lambda c: c % 4)
    f = FilteredProblems(inner, problems, PromptFilterConfig(enabled=True, window=1, readmit_after=2))
    assert [f.index(c) for c in range(4)] == [0, 1, 2, 3]
    # step 0: p0 all wrong, p1 all right, p2 mixed, p3 not sampled
    seen = [("", 0.0, problems[0]), ("", 0.0, problems[0]), ("", 1.0, problems[1]), ("", 1.0, problems[1]),
            ("", 1.0, problems[2]), ("", 0.0, problems[2])]
    assert f.record(0, seen) == {"filter/skipped": 0.0, "filter/skipped_frac": 0.0}
    assert [f.index(c) for c in range(4, 6)] == [2, 3]  # the next epoch: p0 and p1 skipped
    stats = f.record(1, [("", 1.0, problems[2]), ("", 0.0, problems[2])])
    assert stats["filter/skipped"] == 2 and stats["filter/skipped_frac"] == pytest.approx(2 / 3)
    assert f.index(5) == 3 and f.index(2) == 2  # a mapped position keeps its problem
    # step 2: two steps after their last group, p0 and p1 are readmitted
    assert [f.index(c) for c in range(6, 8)] == [0, 1]


def test_prompt_filter_in_training_logs_its_share(tmp_path, monkeypatch):
    from meshrl.tasks.tiny import RepeatTask

    monkeypatch.setattr(RepeatTask, "score", lambda self, completion, problem: 0.0)  # every group all wrong
    hist = train(_cfg("plugins.prompt_filter.enabled=true", "plugins.prompt_filter.readmit_after=100",
                      "task_options.size=8", steps=3), tmp_path / "f")
    assert [m["filter/skipped"] for m in hist[:2]] == [0.0, 0.0]  # the first epoch: no history yet
    assert hist[2]["filter/skipped"] > 0 and 0 < hist[2]["filter/skipped_frac"] <= 1
    with pytest.raises(ValueError, match=r"plugins\.prompt_filter\.window"):
        load_config(overrides=["plugins.prompt_filter.window=0"])


def _without_times(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]


@pytest.mark.parametrize("extra", [
    ["plugins.replay.reuse_steps=2", "plugins.m2po.enabled=true"],
    ["plugins.prompt_filter.enabled=true", "plugins.prompt_filter.readmit_after=2", "task_options.size=8"],
])
def test_replay_and_prompt_filter_state_survives_a_resume(tmp_path, monkeypatch, extra):
    # A resume from step 2 (mid replay cycle; after the filter has a history) must reproduce the uninterrupted run.
    if "plugins.prompt_filter.enabled=true" in extra:
        from meshrl.tasks.tiny import RepeatTask

        real = RepeatTask.score
        # problems p with an even id are always wrong (uniform groups: skipped), the others score as usual
        monkeypatch.setattr(RepeatTask, "score", lambda self, c, p: 0.0 if hash(p.id) % 2 == 0 else real(self, c, p))
    over = [*extra, "checkpoint.every=1", "checkpoint.keep_last=10", "train.update_workers=1"]
    full = train(_cfg(*over, steps=5), tmp_path / "full")
    part = tmp_path / "part"
    train(_cfg(*over, steps=2), part)
    state = json.loads((part / "checkpoints" / "step_000002" / "state.json").read_text())
    key = "replay" if "plugins.replay.reuse_steps=2" in extra else "prompt_filter"
    assert state["plugins"][key] is not None
    resumed = train(_cfg(*over, steps=5), part, resume=True)
    assert _without_times(resumed) == _without_times(full[2:])
    if key == "prompt_filter":
        assert any(m["filter/skipped"] > 0 for m in full)


def test_a_checkpoint_without_plugin_state_resumes_afresh_with_a_warning(tmp_path, caplog):
    over = ["plugins.replay.reuse_steps=2", "checkpoint.every=1", "train.update_workers=1"]
    run = tmp_path / "r"
    train(_cfg(*over, steps=1), run)
    path = run / "checkpoints" / "step_000001" / "state.json"
    state = json.loads(path.read_text())
    del state["plugins"]
    path.write_text(json.dumps(state))
    with caplog.at_level("WARNING", logger="meshrl"):
        hist = train(_cfg(*over, steps=2), run, resume=True)
    assert "no state of plugins.replay" in caplog.text
    assert hist[-1]["replay/age"] == 0.0  # a new cycle: fresh rollouts


def test_plugin_state_round_trips_step_data_exactly(tmp_path):
    from meshrl.trainer.plugins.replay import replay_from_json, replay_to_json

    t = _trainer(tmp_path, "t", "plugins.replay.reuse_steps=1", "train.update_workers=1")
    data, _ = t.plugins.sample(t.sampler, 0, 0)
    data.group_ids = [(g, 1) for g in data.query_ids]  # tuple groups (Mesh prefix groups) too
    logps = [lp.to(torch.bfloat16) for lp in t.forward.logps(t.model, data)]
    data.replace_row(1, dataclasses.replace(data.row(1), origin="luffy", unsampled=len(data.response_ids[1])))
    data.replace_row(3, dataclasses.replace(data.row(3), origin="coach_guide", unsampled=2))  # provenance travels
    text = json.dumps(replay_to_json((data, logps, 7)))
    back, back_logps, born = replay_from_json(json.loads(text), {str(p.id): p for p in t.problems})
    assert born == 7 and back.rows_from("luffy") == {1} and back.unsampled[3] == 2
    for name in ("prompt_ids", "response_ids", "texts", "truncated", "query_ids", "strategy_ids", "scores",
                 "rollout_logps", "group_ids", "stats", "origin", "unsampled"):
        assert getattr(back, name) == getattr(data, name), name
    # a batch stored before rows carried their provenance: trace rows beside it, openings as forced_tokens
    old = json.loads(text)
    del old["data"]["origin"], old["data"]["unsampled"]
    old["data"]["forced_tokens"] = [0, 0, 0, 2] + [0] * (len(data) - 4)
    old["off_rows"] = [1]
    was, _, _ = replay_from_json(old, {str(p.id): p for p in t.problems})
    assert (was.origin, was.unsampled) == (data.origin, data.unsampled)
    assert [p.id for p in back.problems] == [p.id for p in data.problems]
    assert torch.equal(back.advantages, data.advantages) and torch.equal(back.rewards, data.rewards)
    assert [(x, s, p.id) for x, s, p in back.seen] == [(x, s, p.id) for x, s, p in data.seen]
    for a, b in zip(back_logps, logps, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    with pytest.raises(ValueError, match="not among the task's training problems"):
        replay_from_json(json.loads(text), {})
    t.close()


def test_clip_cov_candidates_leave_out_what_each_loss_already_clipped():
    from meshrl.algos import clipped_by_loss, policy_loss

    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 6, generator=g).requires_grad_()
    old = logp.detach() + 0.6 * (torch.rand(4, 6, generator=g) - 0.5)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])[:, None].expand(4, 6)
    mask = torch.ones(4, 6)
    mask[3, 4:] = 0
    for name, cfg in [("ppo_clip", {"clip_low": 0.1, "clip_high": 0.1, "clip_dual": 1.2}),
                      ("gspo_token", {"clip_low": 0.01, "clip_high": 0.01}),
                      ("cispo", {"clip_low": 0.05, "clip_high": 0.05})]:
        # a token is "already clipped" exactly when the recipe's loss gives it no gradient
        loss, _ = policy_loss(name, logp, old, adv, mask, **cfg)
        grad, = torch.autograd.grad((loss * mask).sum(), logp)
        no_grad = (grad == 0) & (mask > 0)
        clipped = clipped_by_loss(name, logp, old, adv, mask, cfg) & (mask > 0)
        assert torch.equal(clipped, no_grad), name
        if name != "cispo":
            assert clipped.any(), name  # the case exercises the clip


def test_replay_with_nothing_stored_resumes_without_a_warning(caplog):
    """A checkpoint taken before replay stored a batch holds replay's (empty) state: the resume restores "nothing
    stored" instead of warning that the checkpoint has no state of plugins.replay."""
    pc = PluginsConfig()
    pc.replay.reuse_steps = 2
    saved = TrainPlugins(pc, _context()).state_dict()
    assert saved == {"replay": {}}
    resumed = TrainPlugins(pc, _context())
    with caplog.at_level("WARNING", logger="meshrl"):
        resumed.load_state_dict(saved)
    assert "no state of plugins.replay" not in caplog.text
    assert resumed.get("replay").stored is None


def test_replay_keeps_the_batch_every_after_sampling_hook_produced(tmp_path):
    """A plug-in at a later stage than replay may return a new batch from after_sampling (LUFFY mixes traces in,
    coach_guide adds openings): replay must reuse that final batch, not the sampler's."""
    import dataclasses

    from meshrl.trainer.plugins.base import Plugin

    class Swapper(Plugin):  # stands for any plug-in that replaces the batch object
        name = "swapper"
        order = 9.0

        def after_sampling(self, step, data, sampler):
            return dataclasses.replace(data, stats={**data.stats, "swapped": 1.0})

    t = _trainer(tmp_path, "t", "plugins.replay.reuse_steps=1", "train.update_workers=1")
    swapper = Swapper(None, t.plugins.active[0].ctx)
    t.plugins.active.append(swapper)
    first, cursor = t.plugins.sample(t.sampler, 0, 0)
    assert first.stats["swapped"] == 1.0
    again, _ = t.plugins.sample(t.sampler, 1, cursor)
    assert again.texts is first.texts and again.stats["swapped"] == 1.0
    assert t.plugins.get("replay").stored[0] is first
