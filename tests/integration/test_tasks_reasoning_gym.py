"""Tests for meshrl.tasks' reasoning-gym tasks, on the reasoning_gym package itself."""

from __future__ import annotations

import pytest

from meshrl.tasks import load_task


def _rewards():
    """The rewards module, or skip when it has not landed yet (it may be a bare namespace package)."""
    rewards = pytest.importorskip("meshrl.rewards")
    if not hasattr(rewards, "grade") or not hasattr(rewards, "extract_answer"):
        pytest.skip("meshrl.rewards does not provide grade/extract_answer yet")
    return rewards


# --- reasoning-gym -----------------------------------------------------------------------------


def test_rg_basic_arithmetic_problems():
    pytest.importorskip("reasoning_gym")
    task = load_task("rg:basic_arithmetic?size=20&eval_size=10", seed=7)
    train, held = task.problems("train"), task.problems("eval")
    assert len(train) == 20 and 0 < len(held) <= 10
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    first = train[0]
    assert first.meta["entry"]["question"] == first.prompt and first.meta["entry"]["answer"] == first.answer
    assert "<answer>" in task.format_prompt(first)
    same = load_task("rg:basic_arithmetic", seed=7, size=20, eval_size=3)
    assert [p.prompt for p in same.problems()] == [p.prompt for p in train]
    assert [p.prompt for p in load_task("rg:basic_arithmetic?size=20", seed=8).problems()] != [
        p.prompt for p in train
    ]


def test_rg_options_and_errors():
    pytest.importorskip("reasoning_gym")
    task = load_task('rg:basic_arithmetic?size=8&max_terms=2&operators=["+"]&allow_negation=false')
    assert task.config == {"max_terms": 2, "operators": ["+"], "allow_negation": False}
    assert all(p.prompt.count("+") == 1 and not {"*", "/"} & set(p.prompt) for p in task.problems())
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        load_task("rg:no_such_dataset")
    with pytest.raises(ValueError, match="invalid dataset options"):
        load_task("rg:basic_arithmetic?no_such_option=1")


@pytest.mark.parametrize("name", ["basic_arithmetic", "spell_backward"])
def test_rg_scoring_uses_strict_extraction(name):
    pytest.importorskip("reasoning_gym")
    _rewards()
    task = load_task(f"rg:{name}?size=6&eval_size=0")
    for problem in task.problems():
        assert task.score(f"Let me think.\n<answer>{problem.answer}</answer>", problem) == 1.0
        assert task.score(f"\\boxed{{{problem.answer}}}", problem) == 1.0
        assert task.score(problem.prompt, problem) == 0.0
        assert task.score(problem.answer, problem) == 0.0  # bare answer: nothing to extract strictly
        assert task.score("<answer>wrong</answer>", problem) == 0.0
        if problem.answer.lstrip("-").isdigit():
            assert task.score(f"<answer>{int(problem.answer) + 1}</answer>", problem) == 0.0
        assert task.score("", problem) == 0.0
