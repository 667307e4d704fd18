"""``plugins.coach_guide`` (coach-guided exploration): the coach's strategy as the first, off-policy tokens of the
response under the unconditioned prompt. Sampling (openings forced, budgets kept, the free path unchanged), the
loss (LUFFY's shaping on the forced tokens only, checked against the formula), one advantage group per query,
end-to-end training, and the settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch

import meshrl.testbed  # noqa: F401  (registers the testbed tasks)
from meshrl.algos import aggregate, group_advantages, ppo_clip_loss
from meshrl.rollout import RolloutBackend, Rollouts, SamplingParams
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.loss import UpdateInputs
from meshrl.trainer.openings import generate_with_openings as generate_guided
from meshrl.trainer.openings import opening_ids
from meshrl.trainer.plugins.coach_guide import CoachGuideConfig, guided_policy_term

GUIDED = ["model=tiny", "task=testbed:add", "recipe=cp_only", "mesh.m=3", "mesh.template=plain",
          "mesh.adv_unit=query", "rollout.group_size=12", "rollout.prompts_per_step=2", "rollout.max_new_tokens=23",
          "plugins.coach_guide.enabled=true", "log.progress=false", "train.update_workers=1",
          "train.micro_batch_size=48",
          "checkpoint.every=100", "optim.lr=1e-3"]


class FakeBackend(RolloutBackend):
    """Deterministic sampler: each sample is ``max_new_tokens`` copies of (seed + prompt length) % 50 + 10."""

    name = "fake"

    def sync_weights(self, model) -> None:
        pass

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []  # (prompts, max_new_tokens, seed)

    def generate(self, prompt_ids, params, *, seed):
        self.calls.append((len(prompt_ids), params.max_new_tokens, seed))
        out = Rollouts(engine_logprobs=[])
        for i, p in enumerate(prompt_ids):
            for k in range(params.n):
                tok = (seed + len(p) + k) % 50 + 10
                out.prompt_index.append(i)
                out.prompt_ids.append(list(p))
                out.response_ids.append([tok] * params.max_new_tokens)
                out.texts.append(chr(tok) * params.max_new_tokens)
                out.truncated.append(True)
                out.engine_logprobs.append([-0.5] * params.max_new_tokens)
        return out


def test_generate_guided_without_openings_is_one_plain_call():
    prompts = [[1, 2, 3], [4, 5]]
    params = SamplingParams(max_new_tokens=6, n=2)
    plain = FakeBackend().generate(prompts, params, seed=11)
    backend = FakeBackend()
    rows = generate_guided(backend, prompts, [([], ""), ([], "")], params, seed=11)
    assert backend.calls == [(2, 6, 11)]
    assert [r["response_ids"] for r in rows] == plain.response_ids
    assert [r["text"] for r in rows] == plain.texts
    assert [r["logps"] for r in rows] == plain.engine_logprobs and all(r["forced"] == 0 for r in rows)


def test_generate_guided_forces_openings_and_keeps_the_response_budget():
    prompts = [[1, 2, 3], [4, 5], [6]]
    openings = [([90, 91], "ab"), ([], ""), ([92], "c")]
    backend = FakeBackend()
    rows = generate_guided(backend, prompts, openings, SamplingParams(max_new_tokens=6, n=2), seed=5)
    # one call per opening length, the free one with the plain seed; a guided row samples 6 - len(opening)
    assert sorted(backend.calls) == [(1, 4, 5 + 2 * 7919), (1, 5, 5 + 7919), (1, 6, 5)]
    assert [r["prompt_index"] for r in rows] == [0, 0, 1, 1, 2, 2]  # prompt-major, as a plain call
    for r in rows:
        i = r["prompt_index"]
        op, text = openings[i]
        assert r["prompt_ids"] == prompts[i]  # the opening is part of the response, not of the prompt
        assert r["response_ids"][: len(op)] == op and len(r["response_ids"]) == 6
        assert r["text"].startswith(text) and r["forced"] == len(op)
        assert (r["logps"] is None) == bool(op)  # the sampler did not choose a guided row's opening


def test_guided_policy_term_is_luffy_on_the_opening_and_the_recipe_elsewhere():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g) * 3).requires_grad_()
    old = logp.detach() - 0.1 * torch.rand(3, 5, generator=g)
    adv = torch.tensor([1.5, -0.5, 2.0])[:, None].expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    pg, _ = ppo_clip_loss(logp, old, adv, mask)
    out, stats = guided_policy_term(CoachGuideConfig(gamma=0.1), [2, 0, 3], logp, adv, mask, pg)
    p = logp.detach().exp()
    want = pg.detach().clone()
    want[0, :2] = -1.5 * p[0, :2] / (p[0, :2] + 0.1)  # row 0: two forced tokens
    want[2, 0] = -2.0 * p[2, 0] / (p[2, 0] + 0.1)  # row 2: three forced, one of them valid
    torch.testing.assert_close(out.detach()[:, :4], want[:, :4])
    assert stats["guide/frac_tokens"] == pytest.approx(3 / 10)
    assert stats["guide/prob_mean"] == pytest.approx(float((p[0, 0] + p[0, 1] + p[2, 0]) / 3))
    assert stats["guide/logp_mean"] == pytest.approx(float((logp[0, 0] + logp[0, 1] + logp[2, 0]) / 3))
    # the gradient of a forced token is LUFFY's: -A gamma / (p + gamma)^2 * p  (d p / d logp = p)
    (out * mask).sum().backward()
    want_g = 1.5 * 0.1 / (p[0, 0] + 0.1) ** 2 * p[0, 0]
    assert float(-logp.grad[0, 0]) == pytest.approx(float(want_g), rel=1e-5)
    out2, _ = guided_policy_term(CoachGuideConfig(shape="none"), [1, 0, 0], logp.detach(), adv, mask, pg.detach())
    assert float(out2[0, 0]) == pytest.approx(float(-1.5 * p[0, 0]))
    out3, _ = guided_policy_term(CoachGuideConfig(shape="log"), [1, 0, 0], logp.detach(), adv, mask, pg.detach())
    assert float(out3[0, 0]) == pytest.approx(float(-1.5 * logp[0, 0]))


def test_openings_come_from_the_task_or_default_to_the_prefix_line(tmp_path):
    from meshrl.tasks import load_task
    from meshrl.testbed.task import COACH_VARIANTS

    task = load_task("testbed:add", seed=0)
    problem = task.problems("train")[0]
    assert task.response_opening(problem, COACH_VARIANTS["r"][2]) == "r:"
    with pytest.raises(ValueError, match="describes none"):
        task.response_opening(problem, "Think hard.")
    plain = load_task("tiny:add", seed=0)  # the Task default: the prefix as the response's first line
    assert plain.response_opening(problem, "Use a table.") == "Use a table.\n"
    t = Trainer(load_config(overrides=[*GUIDED, "steps=1"]), tmp_path / "t")
    try:
        with pytest.raises(ValueError, match=r"rollout\.max_new_tokens=2"):
            opening_ids(t.tokenizer, "t:", 2, "plugins.coach_guide")
    finally:
        t.close()


def test_guided_step_opens_responses_with_the_tags_over_one_group_per_query(tmp_path):
    t = Trainer(load_config(overrides=[*GUIDED, "mesh.bare_group=true", "mesh.bare_groups=3", "steps=1"]),
                tmp_path / "t")
    try:
        data, _ = t.plugins.sample(t.sampler, 0, 0)
        tags = {0: "c:", 1: "t:", 2: "r:"}  # the rule coach's prefixes, in STRATEGIES order
        assert len(data) == 2 * 12
        for i in range(len(data)):
            k = data.strategy_ids[i]
            problem = data.problems[i]
            assert data.prompt_ids[i] == t.sampler.prompt_ids(problem, -1)  # always the unconditioned prompt
            assert len(data.response_ids[i]) <= 23
            if k >= 0:
                tag = t.tokenizer.encode(tags[k], add_special_tokens=False)
                assert data.texts[i].startswith(tags[k]) and data.response_ids[i][: len(tag)] == tag
                assert data.unsampled[i] == len(tag) and data.rollout_logps[i] is None
                assert data.origin[i] == "coach_guide"
            else:
                assert data.unsampled[i] == 0 and data.rollout_logps[i] is not None and data.origin[i] == ""
        assert sum(k >= 0 for k in data.strategy_ids) == 12  # 3 strategies x 2 + 3 bare groups x 2, per query
        assert data.group_ids == data.query_ids  # one advantage group per query
        torch.testing.assert_close(data.advantages, group_advantages(data.rewards, data.group_ids))
        assert data.stats["guide/rows"] == 12 and "free/strategy/unlabelled" in data.stats
        # the micro-batch loss: LUFFY's shaping on the forced tokens, the recipe's ppo_clip elsewhere
        data.advantages = torch.randn(len(data), generator=torch.Generator().manual_seed(0))
        idx, mb = next(iter(t.forward.micro_batches(list(range(len(data))), data)))
        r = t.objective.micro_loss(idx, mb, UpdateInputs(data, None, None, 0))
        loss, stats = r.loss, r.stats
        with torch.no_grad():
            logp = token_logprobs(t.forward.logits(t.model, mb), mb.response_ids, 1.0)
        mask = mb.response_mask
        adv = data.advantages[idx][:, None].expand_as(logp)
        on_mat, _ = ppo_clip_loss(logp, logp, adv, mask)
        forced = torch.tensor([data.unsampled[j] for j in idx])[:, None]
        opening = torch.arange(logp.shape[1])[None, :] < forced
        p = logp.exp()
        want = aggregate(torch.where(opening, -adv * p / (p + 0.1), on_mat), mask, "seq-mean-token-mean")
        torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
        assert stats["guide/frac_tokens"] == pytest.approx(float((opening & (mask > 0)).sum() / mask.sum()))
    finally:
        t.close()


@pytest.mark.parametrize("recipe", [["recipe=cp_only"], ["recipe=mesh", "mesh.mu=0.1"]])
def test_guided_training_runs_and_logs(tmp_path, recipe):
    hist = train(load_config(overrides=[*GUIDED, *recipe, "steps=2"]), tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2]
    for m in hist:
        assert m["guide/rows"] == 24 and 0 < m["guide/frac_tokens"] < 1
        assert 0 < m["guide/prob_mean"] < 1 and math.isfinite(m["loss/total"]) and math.isfinite(m["grad/norm"])
        assert "free/strategy/unlabelled" not in m  # no bare groups: every rollout is guided
    if recipe[0] == "recipe=mesh":
        assert "mesh/balance_loss" in hist[-1]


def test_guided_runs_give_the_same_metrics_with_the_same_seed(tmp_path):
    over = [*GUIDED, "mesh.bare_group=true", "mesh.bare_groups=3", "steps=2"]
    a = train(load_config(overrides=over), tmp_path / "a")
    b = train(load_config(overrides=over), tmp_path / "b")
    for x, y in zip(a, b, strict=True):
        for k, v in x.items():
            if not k.startswith(("time/", "throughput/")):
                assert y[k] == v, k


@pytest.mark.parametrize(("overrides", "match"), [
    (["recipe=grpo"], r"plugins\.coach_guide\.enabled needs a recipe with a coach"),
    (["mesh.adv_unit=prefix_group"], r"mesh\.adv_unit=query"),
    (["plugins.coach_guide.gamma=0"], r"plugins\.coach_guide\.gamma"),
    (["plugins.coach_guide.shape=exp"], r"plugins\.coach_guide\.shape"),
    (["recipe=cp_only", "mesh.base=gspo"], r"plugins\.coach_guide\.enabled needs a token-level policy loss"),
])
def test_bad_guide_settings_are_refused_by_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(overrides=[*GUIDED, *overrides])


def test_luffy_traces_replace_guided_rows_whole(tmp_path):
    import json

    from meshrl.tasks import load_task

    task = load_task("testbed:add", seed=0)
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "completion": task.reference_trace(p, "t")}) + "\n"
                            for p in task.problems("train")))
    t = Trainer(load_config(overrides=[*GUIDED, "plugins.luffy.enabled=true", f"plugins.luffy.traces={path}",
                                       "steps=1"]), tmp_path / "t")
    try:
        data, _ = t.plugins.sample(t.sampler, 0, 0)
        traces = data.rows_from("luffy")
        assert traces and all(data.unsampled[i] == len(data.response_ids[i]) for i in traces)  # all off-policy
        assert all(data.origin[i] == "coach_guide" and data.unsampled[i] > 0 for i in range(len(data))
                   if i not in traces)
        m = t.step()
        assert m["offpolicy/rows"] >= 1 and m["guide/rows"] + m["offpolicy/rows"] == 24  # every row guided or a trace
    finally:
        t.close()
