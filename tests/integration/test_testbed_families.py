"""The testbed task families beyond the basics: the exact test, the applicable coach, the coach-following reward,
the audit family, the warm-start settings and the trainer hooks they use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import meshrl.testbed  # noqa: F401  (registers the testbed tasks)
from meshrl.rollout import RolloutBackend
from meshrl.stats import fisher_exact
from meshrl.tasks import load_task
from meshrl.testbed.audit import AUDIT_BUDGET, audit_feasible, audit_pool, audit_type
from meshrl.testbed.task import A_RANGE, B_RANGE, COACH_VARIANTS, applicable_prefixes, prefix_strategy
from meshrl.testbed.traces import STRATEGIES, label_strategy, reference_trace

TABLES = [[[5, 0], [1, 4]], [[4, 1], [2, 3]], [[0, 5], [0, 5]], [[3, 2], [3, 2]], [[8, 2], [1, 5]],
          [[0, 3], [6, 1]], [[10, 0], [0, 10]], [[2, 7], [9, 1]], [[1, 0], [0, 0]], [[12, 5], [3, 9]]]


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("alternative", ["two-sided", "less", "greater"])
def test_fisher_exact_matches_scipy(table, alternative):
    scipy_stats = pytest.importorskip("scipy.stats")
    ours = fisher_exact(table, alternative)
    ref = scipy_stats.fisher_exact(table, alternative=alternative)
    assert ours.p_value == pytest.approx(float(ref.pvalue), rel=1e-9, abs=1e-12)
    a, b, c, d = table[0] + table[1]
    if b * c:
        assert ours.odds_ratio == pytest.approx(float(ref.statistic))


def test_fisher_exact_hand_case_and_bad_input():
    # [[5, 0], [0, 5]]: the observed table and its mirror are the only ones as extreme: 2 / C(10, 5) = 2 / 252.
    assert fisher_exact([[5, 0], [0, 5]]).p_value == pytest.approx(2 / 252)
    assert fisher_exact([[5, 0], [0, 5]], "greater").p_value == pytest.approx(1 / 252)
    with pytest.raises(ValueError, match="2x2"):
        fisher_exact([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="non-negative integer"):
        fisher_exact([[1, -1], [2, 3]])
    with pytest.raises(ValueError, match="alternative"):
        fisher_exact([[1, 1], [2, 3]], "both")


def test_applicable_coach_proposes_only_procedures_that_fit():
    from meshrl.mesh.coach.validate import PrefixRules, validate_strategies

    task = load_task("testbed:add", coach="applicable", size=300, eval_size=0)
    seen = set()
    for p in task.problems("train"):
        prefixes = task.coach_strategies(p)
        named = [prefix_strategy(x) for x in prefixes]
        assert set(named) <= task.feasible(p) and len(prefixes) == 3
        assert validate_strategies([{"prefix": x} for x in prefixes], p.answer, PrefixRules(m=3)) == []
        seen.add((p.meta["type"], tuple(named)))
    assert ("carry", ("r", "r", "r")) in seen and ("decade", ("t", "t", "t")) in seen
    # the default coach still names all three procedures, in STRATEGIES order
    default = load_task("testbed:add", size=5, eval_size=0)
    p = default.problems("train")[0]
    assert [prefix_strategy(x) for x in default.coach_strategies(p)] == list(STRATEGIES)
    assert applicable_prefixes({"c", "r"}) == [COACH_VARIANTS["c"][0], COACH_VARIANTS["r"][0], COACH_VARIANTS["c"][1]]
    with pytest.raises(ValueError, match="no procedure"):
        applicable_prefixes(set())
    with pytest.raises(ValueError, match="coach must be"):
        load_task("testbed:add", coach="oracle")


def test_coach_following_reward():
    task = load_task("testbed:add", follow=True, size=50, eval_size=0)
    p = next(q for q in task.problems("train") if q.meta["type"] == "low" and q.meta["b"] % 10)
    a, b = p.meta["a"], p.meta["b"]
    col, rnd = reference_trace(a, b, "c"), reference_trace(a, b, "r")
    assert task.score(col, p) == 1.0 and task.score(rnd, p) == 1.0  # both fit a low problem
    assert task.conditioned_score(1.0, col, p, COACH_VARIANTS["c"][0]) == 1.0
    assert task.conditioned_score(1.0, rnd, p, COACH_VARIANTS["c"][0]) == 0.0  # abandoned its prefix
    assert task.conditioned_score(1.0, rnd, p, COACH_VARIANTS["r"][2]) == 1.0  # a rephrased prefix counts
    assert task.conditioned_score(0.0, col, p, COACH_VARIANTS["c"][0]) == 0.0
    plain = load_task("testbed:add", size=50, eval_size=0)
    assert plain.conditioned_score(1.0, rnd, p, COACH_VARIANTS["c"][0]) == 1.0  # off by default
    with pytest.raises(ValueError, match="follow must be"):
        load_task("testbed:add", follow="false")


def test_audit_family_niche_holds_for_every_pair():
    task = load_task("testbed:audit", size=10, eval_size=10)
    counts = {"plain": 0, "carry": 0}
    for a in A_RANGE:
        for b in B_RANGE:
            kind = audit_type(a, b)
            counts[kind] += 1
            problem = SimpleNamespace(answer=str(a + b), meta={"a": a, "b": b, "type": kind})
            scoring = {s for s in STRATEGIES if task.score(reference_trace(a, b, s), problem) == 1.0}
            assert scoring == audit_feasible(a, b)
            assert all(len(reference_trace(a, b, s)) <= AUDIT_BUDGET for s in STRATEGIES)
    assert counts["carry"] > 0 and counts["plain"] > 0
    # c is the longest procedure on every carry problem
    assert all(len(reference_trace(a, b, "c")) >= len(reference_trace(a, b, "r"))
               for a, b in audit_pool(False)["carry"][:2000])
    train, held = set(audit_pool(False)["carry"]), set(audit_pool(True)["carry"])
    assert not train & held
    p = next(q for q in task.problems("eval") if q.meta["type"] == "carry")
    a, b = p.meta["a"], p.meta["b"]
    assert task.score(reference_trace(a, b, "r"), p) == 0.0 and task.score(reference_trace(a, b, "c"), p) == 1.0
    assert all(label_strategy(reference_trace(a, b, s)) == s for s in STRATEGIES)  # the parser labels it
    assert [prefix_strategy(x) for x in load_task("testbed:audit", coach="applicable", size=5).coach_strategies(p)] \
        == ["c", "c", "c"]
    assert task.max_new_tokens == AUDIT_BUDGET + 1 and task.headline_niche == "carry"
    with pytest.raises(ValueError, match="unknown option"):
        load_task("testbed:audit", reward="answer")


def test_warm_settings_per_family_keep_the_default_cache_name():
    from meshrl.testbed.warm import _Examples, settings_hash, warm_settings

    kw = {"seed": 0, "steps": 700, "preset": "tiny:small", "batch_size": 64, "lr": 3e-3, "coach_fraction": 0.06}
    assert settings_hash(warm_settings(**kw)) == "134e5de0d2f0"  # the default warm start's cache name
    audit = warm_settings(**kw, task="testbed:audit")
    assert audit["prior"]["c"] == 0.1 and audit["budget"] == AUDIT_BUDGET and settings_hash(audit) != "134e5de0d2f0"
    assert "coach_variants" in warm_settings(**kw, coach_variants=True)
    with pytest.raises(ValueError, match="unknown task family"):
        warm_settings(**kw, task="testbed:mul")
    from meshrl.models import build_tiny

    _, tok = build_tiny("tiny:small", seed=0)
    data = _Examples(tok, {**audit, "batch_size": 400})
    tags = [tok.decode(r[1][:1]) for r in data._rows(400, None)]
    assert 0.04 < tags.count("c") / len(tags) < 0.18  # c is the rare procedure of the audit warm start
    variants = _Examples(tok, {**warm_settings(**kw, coach_variants=True), "batch_size": 8})
    assert len(variants.systems["r", "plain"]) == 3


def _step(cfg, task, prefixes, texts_for):
    """A RolloutStep over a fake backend that answers each prompt with ``texts_for(problem, strategy)``."""
    from meshrl.trainer.rollout_step import ProblemStream, PromptBudget, RolloutStep
    from meshrl.trainer.scoring import Scoring

    step = RolloutStep.__new__(RolloutStep)
    step.task, step.problems, step.cfg, step.prefixes = task, task.problems("train"), cfg, prefixes
    step.budget = PromptBudget(None, cfg.rollout.max_new_tokens)  # the fake model has no position limit
    step.problem_stream = ProblemStream(len(step.problems), cfg.seed)
    step.prompt_ids = lambda problem, k=-1: [k + 2]
    step.rewards = lambda texts, problems: [task.score(t, p) for t, p in zip(texts, problems, strict=True)]
    step.scoring = Scoring(task=task, reward_runner=step.rewards, recipe=cfg.resolved_recipe(),
                           max_new_tokens=cfg.rollout.max_new_tokens, prefixes=prefixes)

    class Backend(RolloutBackend):
        def sync_weights(self, model):
            pass

        def generate(self, prompts, params, seed):
            rows = [(i, k) for i, k in enumerate(prompts) for _ in range(params.n)]
            arms = step._arms_cache
            texts = [texts_for(step._chosen[arms[i][0]], arms[i][1]) for i, _ in rows]
            return SimpleNamespace(prompt_index=[i for i, _ in rows], prompt_ids=[[0]] * len(rows),
                                   response_ids=[[1]] * len(rows), texts=texts, truncated=[False] * len(rows),
                                   engine_logprobs=None)

    original = step._arms

    def arms(chosen):
        out = original(chosen)
        step._arms_cache, step._chosen = out[0], chosen
        return out

    step._arms, step.backend = arms, Backend()
    return step


def test_trainer_hooks_bare_groups_and_conditioned_score():
    from meshrl.trainer import load_config

    task = load_task("testbed:add", follow=True, size=20, eval_size=0)
    prefixes = {p.id: task.coach_strategies(p) for p in task.problems("train")}
    cfg = load_config(overrides=["recipe=mesh", "task=testbed:add", "rollout.group_size=12", "mesh.m=3",
                                 "mesh.bare_group=true", "mesh.bare_groups=3", "rollout.prompts_per_step=2"])
    # every rollout writes the round-and-adjust trace: correct on low/carry problems whatever its prefix
    step = _step(cfg, task, prefixes, lambda p, k: reference_trace(p.meta["a"], p.meta["b"], "r"))
    data, _ = step._sample(0, 2, seed=0)
    assert len(data) == 24 and data.strategy_ids.count(-1) == 12  # half the budget prefix-free
    assert {data.strategy_ids.count(k) for k in range(3)} == {4}
    for score, k, p in zip(data.scores, data.strategy_ids, data.problems, strict=True):
        fits = "r" in task.feasible(p)
        assert score == (1.0 if fits and k in (-1, 2) else 0.0)  # only prefix 2 (r) and bare rollouts keep it
    with pytest.raises(ValueError, match="bare_groups"):
        load_config(overrides=["recipe=mesh", "mesh.bare_group=true", "mesh.bare_groups=0"])
    with pytest.raises(ValueError, match=r"\+ 2 \(mesh.bare_group\)"):
        load_config(overrides=["recipe=mesh", "mesh.m=3", "mesh.bare_group=true", "mesh.bare_groups=2",
                               "rollout.group_size=12"])
