"""Reward kinds of file tasks: the default instruction per kind, last_number, references checked per kind."""

from __future__ import annotations

import json

import pytest

from meshrl.tasks import BOXED_INSTRUCTION, DEFAULT_INSTRUCTIONS, LAST_NUMBER_INSTRUCTION, load_task, with_kind


@pytest.fixture
def sums(tmp_path):
    f = tmp_path / "sums.jsonl"
    f.write_text("".join(json.dumps({"id": f"s{i}", "problem": f"What is {i}+1?", "answer": i + 1}) + "\n"
                         for i in range(4)))
    return f


@pytest.mark.parametrize(("kind", "expected"), [("math", BOXED_INSTRUCTION), ("number", BOXED_INSTRUCTION),
                                                ("exact", BOXED_INSTRUCTION), ("last_number", LAST_NUMBER_INSTRUCTION)])
def test_default_instruction_per_kind(sums, kind, expected):
    task = load_task(f"jsonl:{sums}?kind={kind}")
    assert task.instruction == expected == DEFAULT_INSTRUCTIONS[kind]
    assert task.format_prompt(task.problems()[0]) == f"What is 0+1?\n\n{expected}"


def test_explicit_and_empty_instructions_win(sums):
    assert load_task(f"jsonl:{sums}?kind=last_number&instruction=Just the number.").instruction == "Just the number."
    task = load_task(f"jsonl:{sums}?kind=last_number&instruction=")
    assert task.format_prompt(task.problems()[0]) == "What is 0+1?"  # no instruction at all


def test_last_number_task_scores_a_bare_number(sums):
    strict, loose = load_task(f"jsonl:{sums}?kind=number"), load_task(f"jsonl:{sums}?kind=last_number")
    p = strict.problems()[0]
    assert (strict.score("0 + 1 = 1", p), loose.score("0 + 1 = 1", p)) == (0.0, 1.0)


def test_with_kind_changes_grading_only(sums):
    task = load_task(f"jsonl:{sums}")
    loose = with_kind(task, "last_number")
    p = task.problems()[0]
    assert (task.reward_kind, loose.reward_kind) == ("exact", "last_number")
    assert loose.instruction == task.instruction and loose.problems() == task.problems()
    assert (task.score("1", p), task.score("so 1", p), loose.score("so 1", p)) == (0.0, 0.0, 1.0)


def test_with_kind_checks_every_reference(tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_text(json.dumps({"id": "ok", "problem": "p", "answer": "2"}) + "\n"
                 + json.dumps({"id": "word", "problem": "q", "answer": "two"}) + "\n")
    with pytest.raises(ValueError, match=r"problem 'word': the reference answer is not a finite number"):
        with_kind(load_task(f"jsonl:{f}"), "number")
