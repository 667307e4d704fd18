"""The collapse testbed: procedures, parser, niches, strict reward, rule coach, warm start and measurements."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

import meshrl.testbed as tb
from meshrl.tasks import list_tasks, load_task
from meshrl.testbed.task import pair_pool, sample_problems
from meshrl.testbed.traces import GRAMMARS


@pytest.fixture(scope="module")
def task() -> tb.AddTestbed:
    return load_task("testbed:add", size=300, eval_size=120)


def test_registered_and_shaped(task):
    assert "testbed:add" in list_tasks()
    assert task.reward_kind == "custom" and task.instruction is None
    assert task.max_new_tokens == task.budget + 1 == tb.DEFAULT_BUDGET + 1
    probs = task.problems("train")
    assert len(probs) == 300 and len(task.problems("eval")) == 120
    for p in probs:
        a, b = p.meta["a"], p.meta["b"]
        assert p.prompt == f"{a}+{b}" and p.answer == str(a + b) and 100 <= a <= 899 and 10 <= b <= 99
        assert p.meta["type"] == tb.problem_type(a, b) and p.meta["home"] == tb.HOME[p.meta["type"]]
    counts = {k: sum(p.meta["type"] == k for p in probs) for k in tb.TYPES}
    assert counts == {"low": 150, "carry": 75, "decade": 75}


def test_splits_are_deterministic_disjoint_and_seed_independent():
    a, b = load_task("testbed:add", seed=3), load_task("testbed:add", seed=3)
    assert [p.id for p in a.problems("train")] == [p.id for p in b.problems("train")]
    c = load_task("testbed:add", seed=4)
    assert [p.id for p in a.problems("train")] != [p.id for p in c.problems("train")]
    evals = {p.id for t in (a, c) for p in t.problems("eval")}
    trains = {p.id for t in (a, c) for p in t.problems("train")}
    assert not evals & trains  # eval pairs are reserved for every seed


def test_options_mix_and_errors():
    t = load_task("testbed:add?mix=[1,0,1]&size=10&eval_size=4")
    assert {p.meta["type"] for p in t.problems("all")} == {"low", "decade"}
    t = load_task("testbed:add", mix="carry:1", size=5, eval_size=0)
    assert {p.meta["type"] for p in t.problems()} == {"carry"}
    with pytest.raises(ValueError, match="unknown option"):
        load_task("testbed:add", nope=1)
    with pytest.raises(ValueError, match="unknown problem type"):
        load_task("testbed:add", mix={"high": 1})
    with pytest.raises(ValueError, match="only"):
        load_task("testbed:add", mix="decade:1", size=10**6)


def test_reference_traces_are_correct_and_labelled():
    assert tb.reference_trace(573, 48, "c") == "c:3+8=11;7+4+1=12;5+0+1=6|621"
    assert tb.reference_trace(523, 41, "c") == "c:3+1=4;2+4=6|564"
    assert tb.reference_trace(573, 48, "t") == "t:573+40=613;613+8=621|621"
    assert tb.reference_trace(573, 40, "t") == "t:573+40=613|613"
    assert tb.reference_trace(573, 48, "r") == "r:573+50-2=623-2|621"
    assert tb.reference_trace(573, 40, "r") == "r:573+50-10=623-10|613"
    assert tb.reference_trace(503, 91, "r") == "r:503+100-9=603-9|594"
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randrange(100, 900), rng.randrange(10, 100)
        for s in tb.STRATEGIES:
            trace = tb.reference_trace(a, b, s)
            assert tb.label_strategy(trace) == s, trace
            assert tb.strict_reward(trace, str(a + b), budget=99) == 1.0
    with pytest.raises(ValueError, match="unknown strategy"):
        tb.reference_trace(1, 2, "x")


@pytest.mark.parametrize("bad", [
    "", "c", "c:", "x:3+8=11|621", "c 3+8=11|621", "c:3+8=11", "c:3+8=11|", "c:38+8=11|621",
    "c:3+8=11;7+4+2=12|621", "c:3+8=111|621", "c:3+8=11|621 ", "c:3+8=11|0621", "c:3+8=11|62a",
    "t:573+48=621|621", "t:573+40=613;613+18=621|621", "t:573+40=613+8|621", "t:573+4=577|577",
    "r:573+50-2=623-3|621", "r:573+50-2=623|621", "r:573+48-2=623-2|621", "r:573+50-0=623-0|573",
    "r:573+50-11=623-11|612", "c:3+8=11|621|621", "|621", "621", "c:3+8=11;|621",
])
def test_parser_rejects_malformed(bad):
    assert tb.label_strategy(bad) is None


def test_parser_loose_labels_by_the_working():
    assert tb.label_strategy(":5442+50=592|592") is None
    assert tb.label_strategy(":5442+50=592|592", loose=True) == "t"  # tag worn off by RL, procedure kept
    assert tb.label_strategy("r:542+50=592|592", loose=True) == "t"  # the working decides, not the tag
    assert tb.label_strategy("3+8=11;7+4+1=12;5+0+1=6|621", loose=True) == "c"
    assert tb.label_strategy("573+50-2=623-2|621", loose=True) == "r"
    assert tb.label_strategy("|621", loose=True) is None
    assert tb.label_strategy(":5442+5", partial=True, loose=True) is None  # t or r could still follow
    assert tb.label_strategy(":5442+50-", partial=True, loose=True) == "r"


def test_parser_partial_labels_truncated_traces():
    full = tb.reference_trace(573, 48, "c")
    assert tb.label_strategy(full[:21]) is None  # cut by the budget: not a complete trace
    assert tb.label_strategy(full[:21], partial=True) == "c"
    assert tb.label_strategy("c:", partial=True) is None  # the tag alone says nothing about the trace
    assert tb.label_strategy("c:3+8=11;7+", partial=True) == "c"
    assert tb.label_strategy("c:3+8=11;7+x", partial=True) is None
    assert tb.label_strategy("r:573+50-2=623-", partial=True) == "r"
    assert tb.label_strategy("t:573+40=613;61", partial=True) == "t"


def test_grammar_does_not_check_arithmetic():
    assert tb.label_strategy("c:3+8=12;7+4+1=13|631") == "c"  # an attempt at the procedure, wrong sums
    assert tb.strict_reward("c:3+8=12;7+4+1=13|631", "621", 21) == 0.0
    assert set(GRAMMARS) == set(tb.STRATEGIES)


def test_niche_property_holds_for_every_pair():
    """Each type has exactly the feasible procedures its design says, so every type has a home."""
    for held in (False, True):
        for kind, pairs in pair_pool(held).items():
            assert pairs
            for a, b in pairs:
                feasible = tb.feasible_strategies(a, b)
                if kind == "carry":
                    assert feasible == {"r"}
                elif kind == "decade":
                    assert feasible == {"t"}
                else:
                    assert "c" in feasible and feasible == ({"c", "t"} if b % 10 == 0 else {"c", "r"})


def test_over_budget_is_by_a_margin():
    """The dominant procedure does not miss the budget by a hair on the niches: column addition needs
    at least 5 characters more than the budget there, while the home procedure fits."""
    for kind, pairs in pair_pool(False).items():
        for a, b in pairs[::50]:
            lengths = {s: len(tb.reference_trace(a, b, s)) for s in tb.STRATEGIES}
            assert lengths[tb.HOME[kind]] <= tb.DEFAULT_BUDGET
            if kind != "low":
                assert lengths["c"] >= tb.DEFAULT_BUDGET + 5
                assert min(lengths[s] for s in tb.STRATEGIES if s != tb.HOME[kind]) > tb.DEFAULT_BUDGET


def test_strict_answer_reward():
    task = load_task("testbed:add", reward="answer", size=3, eval_size=0)
    p = tb.make_problem(573, 48)
    assert task.score("r:573+50-2=623-2|621", p) == 1.0
    assert task.score("|621", p) == 1.0  # the answer-only reward ignores the working (the parser says None)
    assert task.score("c:3+8=11;7+4+1=12|621", p) == 1.0  # a shortened column trace that fits the budget
    for wrong in ["r:573+50-2=623-2|620", "r:573+50-2=623-2|621\n", "|621|621", "|0621", "621",
                  "c:3+8=11;7+4+1=12;5+0+1=6|621", ""]:
        assert task.score(wrong, p) == 0.0, wrong
    long_ok = "x" * (task.budget - 4) + "|621"
    assert len(long_ok) == task.budget and task.score(long_ok, p) == 1.0
    assert task.score("x" + long_ok, p) == 0.0  # one character over the budget


def test_trace_reward_is_the_default_and_closes_the_behaviours(task):
    assert task.reward == "trace"
    p = tb.make_problem(573, 48)
    assert task.score("r:573+50-2=623-2|621", p) == 1.0
    assert task.score("r:573+50-2=624-2|621", p) == 1.0  # intermediate results are not checked
    for wrong in ["|621", "c:3+8=11;7+4+1=12|621", ":573+50-2=623-2|621", "t:573+50-2=623-2|621",
                  "r:573+40-2=623-2|621", "r:573+50-2=623-2|620", "r:573+50-2=623-2|621 ", "x:|621",
                  "c:3+8=11;7+4+1=12;5+0+1=6|621"]:  # the last is complete but over the budget
        assert task.score(wrong, p) == 0.0, wrong
    with pytest.raises(ValueError, match="reward"):
        load_task("testbed:add", reward="dense")
    for a, b in [(523, 41), (573, 40), (503, 91), (899, 99)]:
        q = tb.make_problem(a, b) if tb.problem_type(a, b) else None
        for s in tb.STRATEGIES:
            trace = tb.reference_trace(a, b, s)
            assert tb.trace_reward(trace, a, b, budget=99) == 1.0
            if q is not None:
                assert task.score(trace, q) == float(len(trace) <= task.budget)


def test_forced_prompt_and_coach(task):
    from meshrl.models import build_char_tokenizer, encode_prompt

    p = task.problems()[0]
    fp = tb.forced_prompt(p, "r")
    assert fp.user == p.prompt and fp.assistant_prefix == "r:" and task.forced_prompt(p, "r").user == p.prompt
    tok = build_char_tokenizer()
    ids = fp.ids(tok)
    assert ids[:-2] == encode_prompt(tok, p.prompt) and tok.decode(ids[-2:]) == "r:"
    with pytest.raises(ValueError):
        tb.forced_prompt(p, "z")
    prefixes = task.coach_strategies(p)
    assert prefixes == tb.coach_strategies() and len(prefixes) == 3
    assert all(not any(ch.isdigit() for ch in text) for text in prefixes)


def test_rule_coach_prefixes_pass_meshrl_validation(task, tmp_path):
    from meshrl.mesh import RuleCoach, generate_prefixes, load_prefixes, query_key

    probs = task.problems()[:20]
    by_id = {p.id: p for p in probs}
    coach = RuleCoach(lambda q: task.coach_strategies(by_id[q["id"]]), name="rule:testbed:add")
    queries = [{"id": p.id, "problem": p.prompt, "answer": p.answer} for p in probs]
    generate_prefixes(queries, coach, m=3, out_path=tmp_path / "prefixes.jsonl")
    table = load_prefixes(tmp_path / "prefixes.jsonl")
    assert all(table[query_key(p.prompt)] == tb.coach_strategies() for p in probs)


def test_sample_problems_is_seeded():
    mix = tb.DEFAULT_MIX
    a = sample_problems(40, mix, random.Random(1), held_out=False)
    b = sample_problems(40, mix, random.Random(1), held_out=False)
    assert [p.id for p in a] == [p.id for p in b] and len({p.id for p in a}) == 40


# --------------------------------------------------------------------------------- warm start (fast)
def _state(path):
    from meshrl.models import load_model

    model, _ = load_model(str(path))
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_warm_start_caches_reuses_and_is_seeded(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    kw = dict(steps=3, preset="tiny", batch_size=8, coach_fraction=0.25, progress=False, threads=1)
    path = tb.warm_start(seed=5, **kw)
    assert path.parent == tmp_path / "cache" / "testbed" and path.name.startswith("warm_")
    info = tb.warm_info(path)
    assert info["settings"]["steps"] == 3 and info["threads"] == 1 and info["seconds"] >= 0
    stamp = (path / "warm_start.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert tb.warm_start(seed=5, **kw) == path
    assert time.perf_counter() - t0 < 1.0 and (path / "warm_start.json").stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    # same seed -> same weights (a forced rebuild elsewhere); another seed -> another directory/weights
    again = tb.warm_start(tmp_path / "again", seed=5, **kw)
    sa, sb = _state(path), _state(again)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    other = tb.warm_start(seed=6, **kw)
    assert other != path and not all(torch.equal(sa[k], v) for k, v in _state(other).items())
    rebuilt = tb.warm_start(seed=5, force=True, **kw)
    assert rebuilt == path and (path / "warm_start.json").stat().st_mtime_ns != stamp


def test_warm_start_refuses_foreign_directories(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("mine")
    kw = dict(steps=1, preset="tiny", batch_size=4, progress=False, threads=1)
    with pytest.raises(ValueError, match="not a testbed warm start"):
        tb.warm_start(tmp_path / "x", **kw)
    path = tb.warm_start(tmp_path / "y", **kw)
    with pytest.raises(ValueError, match="other settings"):
        tb.warm_start(path, seed=9, **kw)
    settings = json.loads((path / "warm_start.json").read_text())["settings"]
    assert settings["seed"] == 0 and settings["version"].startswith("testbed-add-warm")


def test_measurements_on_an_untrained_model(task):
    from meshrl.models import build_tiny

    model, tok = build_tiny("tiny", seed=0)
    probs = task.problems("eval")[:9]
    shares = tb.strategy_shares(model, tok, task, probs, n=2, seed=0)
    assert shares.n_problems == 9 and abs(sum(shares.shares.values()) - 1) < 1e-9
    assert set(shares.accuracy_by_type) <= set(tb.TYPES) and 0 <= shares.accuracy <= 1
    assert "| all |" in shares.table() and shares.to_dict()["max_share"] == shares.max_share
    forced = tb.forced_accuracy(model, tok, task, probs, n=1, seed=0)
    assert set(forced.accuracy) == set(forced.raw_accuracy) == set(forced.followed) == set(tb.STRATEGIES)
    assert set(forced.winners()) == set(forced.accuracy["c"]) and "forced c" in forced.table()


# --------------------------------------------------------------------------------- the real warm start
@pytest.mark.slow
def test_real_warm_start_competes_and_shows_the_niches():
    """The default warm start (trained here when the cache is cold: about 3 minutes on 2 cores; reused
    otherwise): every procedure is sampled, accuracy is well below 1, each type has its own winner under
    forcing, and the model follows plain coach prefixes."""
    from meshrl.models import load_model

    path = tb.warm_start(progress=False)
    model, tok = load_model(str(path))
    task = load_task("testbed:add")
    probs = task.problems("eval")[:96]
    shares = tb.strategy_shares(model, tok, task, probs, n=8, seed=1)
    assert all(shares.shares[s] >= 0.15 for s in tb.STRATEGIES), shares.shares
    assert shares.shares["other"] <= 0.05
    assert 0.25 <= shares.accuracy <= 0.7, shares.accuracy
    forced = tb.forced_accuracy(model, tok, task, probs, n=4, seed=2)
    assert forced.winners() == tb.HOME, forced.table()
    for kind, home in tb.HOME.items():
        assert forced.accuracy[home][kind] >= 0.6, forced.table()
        if kind != "low":  # the niches are hard: no other procedure fits the budget there
            assert all(forced.accuracy[s][kind] <= 0.02 for s in tb.STRATEGIES if s != home)
    coach = tb.coached_shares(model, tok, task, probs[:24], n=4, seed=3, template="plain")
    assert coach.follow_rate() >= 0.8, coach.table()


def test_trainer_masses_use_lenient_labels_and_periodic_eval_reports_the_unconditioned_policy(task, tmp_path):
    from meshrl.trainer import load_config, train

    assert task.label_strategy("c:3+8=11;7+4+1=12;5+0") == "c"  # cut by the budget: still counts as c
    assert task.label_strategy("c:3+8=11;7+4+1=12;5+0", partial=False, loose=False) is None
    cfg = load_config(overrides=[
        "model=tiny", "task=testbed:add", "steps=1", "rollout.prompts_per_step=2", "rollout.group_size=3",
        "rollout.max_new_tokens=22", "eval.every=1", "eval.limit=6", "eval.n=2", "log.progress=false",
        "recipe=cp_only", "mesh.m=3", "mesh.template=plain"])
    hist = train(cfg, tmp_path / "run")
    m = hist[-1]
    masses = [m[f"eval/strategy/mass/{s}"] for s in tb.STRATEGIES]
    assert all(0 <= x <= 1 for x in masses) and sum(masses) <= 1 + 1e-9
    assert 0 <= m.get("eval/strategy/problem_max_mass", 0) <= 1
    assert {k for k in m if k.startswith("eval/acc/type/")} <= {f"eval/acc/type/{t}" for t in tb.TYPES}
    assert any(k.startswith("eval/acc/type/") for k in m)


def test_masses_and_type_accuracy_count_rollouts_dynamic_sampling_dropped(tmp_path):
    """DAPO drops groups whose rollouts all score alike; the policy's masses and per-type accuracy must
    still be measured on every sampled rollout, not only on the kept (mixed) groups."""
    from meshrl.trainer import load_config, train

    cfg = load_config(overrides=[
        "model=tiny", "task=testbed:add", "steps=1", "rollout.prompts_per_step=3", "rollout.group_size=2",
        "rollout.max_new_tokens=22", "log.progress=false", "recipe=dapo", "dynamic_sampling.max_rounds=1"])
    m = train(cfg, tmp_path / "run")[-1]
    assert m["rollouts/count"] == 6 and m["rollouts/kept"] == 0  # an untrained model: every group all-wrong
    assert m["acc/sampled_mean"] == 0.0
    assert any(k.startswith("acc/type/") for k in m)
    assert sum(m[f"strategy/mass/{s}"] for s in tb.STRATEGIES) + m["strategy/unlabelled"] == pytest.approx(1.0)
