"""Tests for meshrl.tasks: registry, file tasks and the tiny tasks (reasoning-gym tasks:
tests/integration/test_tasks_reasoning_gym.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from meshrl.tasks import Problem, Task, data_dir, list_tasks, load_task, register_task
from meshrl.tasks import base as tasks_base
from meshrl.tasks._spec import coerce_value, split_spec


def _rewards():
    """The rewards module, or skip when it has not landed yet (it may be a bare namespace package)."""
    rewards = pytest.importorskip("meshrl.rewards")
    if not hasattr(rewards, "grade") or not hasattr(rewards, "extract_answer"):
        pytest.skip("meshrl.rewards does not provide grade/extract_answer yet")
    return rewards


def _write_jsonl(path: Path, rows: list) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- registry and spec parsing -------------------------------------------------------------------


def test_list_tasks_has_builtins_and_forms():
    names = list_tasks()
    for expected in ("tiny:repeat", "tiny:add", "math500", "gsm8k", "rg:NAME", "jsonl:PATH", "parquet:PATH"):
        assert expected in names


@pytest.mark.parametrize("spec", ["nope", "tiny:nope", "csv:x.csv", ""])
def test_unknown_spec_lists_known_forms(spec):
    with pytest.raises(ValueError, match="known forms") as info:
        load_task(spec)
    assert "rg:NAME" in str(info.value) and "jsonl:PATH" in str(info.value)


def test_prefix_without_argument_and_bad_query():
    with pytest.raises(ValueError, match="jsonl:PATH"):
        load_task("jsonl:")
    with pytest.raises(ValueError, match="key=value"):
        load_task("tiny:add?oops")


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match="unknown option"):
        load_task("tiny:add", colour="red")


def test_register_task_decorator_and_options():
    class Fixed(Task):
        name = "test:fixed"
        splits = ("train",)

        def __init__(self, n: int) -> None:
            self.n = n

        def problems(self, split: str = "train") -> list[Problem]:
            return [Problem(str(i), f"q{i}", str(i)) for i in range(self.n)]

    @register_task("test:fixed")
    def _factory(*, seed: int = 0, n: int = 2) -> Task:
        return Fixed(n + seed)

    try:
        assert "test:fixed" in list_tasks()
        assert len(load_task("test:fixed?n=3").problems()) == 3
        assert len(load_task("test:fixed", seed=1, n=3).problems()) == 4
        assert len(load_task("test:fixed?n=3", n=5).problems()) == 5  # keyword beats query
        with pytest.raises(ValueError, match="already registered"):
            register_task("test:fixed")(_factory)
    finally:
        tasks_base._BUILTINS.pop("test:fixed", None)


def test_spec_parsing_and_coercion():
    base, opts = split_spec('rg:x?a=3&b=0.5&c=true&d=word&e=["+","-"]&f=1%262')
    assert base == "rg:x"
    assert opts == {"a": 3, "b": 0.5, "c": True, "d": "word", "e": ["+", "-"], "f": "1&2"}
    assert coerce_value("-4") == -4 and coerce_value("1e-3") == 1e-3


def test_problem_is_frozen_and_prompt_formatting():
    problem = Problem("p1", "What is 2+2?", "4")
    assert problem.meta == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.answer = "5"  # type: ignore[misc]
    task = load_task("math500") if _has_data() else None
    if task is not None:
        assert task.format_prompt(problem) == "What is 2+2?\n\nPut your final answer within \\boxed{}."
    assert load_task("tiny:add").format_prompt(problem) == "What is 2+2?"


# --- jsonl / parquet files -----------------------------------------------------------------------


def test_jsonl_defaults_numbers_and_id_fallback(tmp_path):
    path = _write_jsonl(
        tmp_path / "p.jsonl",
        [{"problem": "1+1?", "answer": 2, "level": 1}, "", {"problem": "Name?", "answer": "Bob"}],
    )
    task = load_task(f"jsonl:{path}")
    probs = task.problems()
    assert [p.id for p in probs] == ["0", "1"]
    assert [p.answer for p in probs] == ["2", "Bob"]
    assert probs[0].meta["level"] == 1 and probs[1].meta["row"] == 1
    assert task.reward_kind == "exact" and task.splits == ("train", "all")


def test_jsonl_field_mapping_in_spec_and_options(tmp_path):
    rows = [{"question": f"q{i}", "ans": i * 1.5, "idx": f"id{i}"} for i in range(5)]
    path = _write_jsonl(tmp_path / "m.jsonl", rows)
    via_spec = load_task(f"jsonl:{path}?problem=question&answer=ans&id=idx&kind=number")
    via_opts = load_task(
        f"jsonl:{path}", problem_field="question", answer_field="ans", id_field="idx", kind="number"
    )
    for task in (via_spec, via_opts):
        assert task.reward_kind == "number"
        assert [p.id for p in task.problems()] == [f"id{i}" for i in range(5)]
        assert task.problems()[1].prompt == "q1" and task.problems()[1].answer == "1.5"


def test_parquet_loading_with_mapping(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"q": ["a?", "b?", "c?"], "a": [1, 2, 3], "uid": ["x", "y", "z"]})
    path = tmp_path / "p.parquet"
    pq.write_table(table, path)
    task = load_task(f"parquet:{path}?problem=q&answer=a&id=uid&kind=number")
    assert [(p.id, p.prompt, p.answer) for p in task.problems()] == [
        ("x", "a?", "1"),
        ("y", "b?", "2"),
        ("z", "c?", "3"),
    ]


def test_parquet_bad_row_names_row_and_field(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"problem": ["a", "b", "c"], "answer": ["1", "2", " "]}), path)
    with pytest.raises(ValueError, match=r"bad\.parquet, row 3: field 'answer' is empty"):
        load_task(f"parquet:{path}")


GOOD = {"id": "a", "problem": "p", "answer": "1"}


@pytest.mark.parametrize(
    ("bad_line", "field", "message"),
    [
        ('{"id": "b", "problem": "p", "answer": ', None, "malformed JSON"),
        ({"id": "b", "answer": "1"}, "problem", "missing field"),
        ({"id": "b", "problem": "p"}, "answer", "missing field"),
        ({"id": "b", "problem": "   ", "answer": "1"}, "problem", "empty"),
        ({"id": "b", "problem": "p", "answer": ""}, "answer", "empty"),
        ({"id": "b", "problem": ["p"], "answer": "1"}, "problem", "must be a string"),
        ({"id": "b", "problem": "p", "answer": None}, "answer", "missing"),
        ({"id": "b", "problem": "p", "answer": True}, "answer", "must be a string"),
        ({"id": "a", "problem": "p", "answer": "1"}, "id", "repeats id"),
        ('["not", "an", "object"]', None, "JSON object"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path, bad_line, field, message):
    path = _write_jsonl(tmp_path / "broken.jsonl", [GOOD, "", bad_line])
    with pytest.raises(ValueError) as info:
        load_task(f"jsonl:{path}")
    text = str(info.value)
    assert str(path) in text and "line 3" in text and message in text
    if field is not None:
        assert f"'{field}'" in text


def test_malformed_row_with_mapped_field(tmp_path):
    path = _write_jsonl(tmp_path / "m.jsonl", [{"question": "q", "ans": "1"}, {"question": "q2"}])
    with pytest.raises(ValueError, match=r"m\.jsonl, line 2: missing field 'ans'"):
        load_task(f"jsonl:{path}?problem=question&answer=ans")


def test_missing_file_and_bad_kind(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_task(f"jsonl:{tmp_path / 'absent.jsonl'}")
    path = _write_jsonl(tmp_path / "k.jsonl", [GOOD])
    with pytest.raises(ValueError, match="kind"):
        load_task(f"jsonl:{path}?kind=fuzzy")


def test_held_out_split_deterministic_and_disjoint(tmp_path):
    path = _write_jsonl(tmp_path / "s.jsonl", [{"problem": f"p{i}", "answer": str(i)} for i in range(50)])

    def ids(task, split):
        return [p.id for p in task.problems(split)]

    a = load_task(f"jsonl:{path}?eval_fraction=0.2", seed=3)
    b = load_task(f"jsonl:{path}", seed=3, eval_fraction=0.2)
    c = load_task(f"jsonl:{path}?eval_fraction=0.2", seed=4)
    assert ids(a, "eval") == ids(b, "eval") and ids(a, "train") == ids(b, "train")
    assert len(ids(a, "eval")) == 10 and len(ids(a, "train")) == 40
    assert not set(ids(a, "eval")) & set(ids(a, "train"))
    assert set(ids(a, "eval")) | set(ids(a, "train")) == set(ids(a, "all"))
    assert ids(a, "eval") != ids(c, "eval")
    with pytest.raises(ValueError, match="eval_fraction"):
        load_task(f"jsonl:{path}").problems("eval")
    limited = load_task(f"jsonl:{path}?limit=10&eval_fraction=0.3")
    assert ids(limited, "all") == [str(i) for i in range(10)] and len(ids(limited, "eval")) == 3


# --- shared benchmark shortcuts -----------------------------------------------------------------


def _has_data() -> bool:
    try:
        return (data_dir() / "math500.jsonl").is_file() and (data_dir() / "gsm8k_test.jsonl").is_file()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _has_data(), reason="shared data directory not found")
def test_benchmark_shortcuts():
    math500, gsm8k = load_task("math500"), load_task("gsm8k")
    assert len(math500.problems()) == 500 and math500.reward_kind == "math"
    assert len(gsm8k.problems()) == 1319 and gsm8k.reward_kind == "number"
    assert gsm8k.problems()[0].answer == "18" and "solution" in gsm8k.problems()[0].meta
    held = load_task("gsm8k?eval_fraction=0.1", seed=1)
    assert len(held.problems("eval")) == 132 and len(held.problems("train")) == 1187


def test_data_dir_env_override(tmp_path, monkeypatch):
    _write_jsonl(tmp_path / "math500.jsonl", [GOOD])
    monkeypatch.setenv("MESHRL_DATA_DIR", str(tmp_path))
    assert len(load_task("math500").problems()) == 1
    with pytest.raises(FileNotFoundError, match="gsm8k_test.jsonl"):
        load_task("gsm8k")
    monkeypatch.setenv("MESHRL_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="MESHRL_DATA_DIR"):
        load_task("math500")


# --- tiny tasks --------------------------------------------------------------------------------


def test_tiny_repeat_dense_reward():
    task = load_task("tiny:repeat", seed=1)
    assert task.reward_kind == "custom" and task.instruction is None
    train = task.problems("train")
    assert len(train) == 64 and len(task.problems("eval")) == 16
    assert sorted({p.answer for p in train}) == sorted("0123456789abcdef")
    problem = next(p for p in train if p.answer == "7")
    assert problem.prompt == "Repeat: 7"
    cases = {"7": 1.0, " 7 7\n": 1.0, "77x7": 0.75, "7a": 0.5, "abc": 0.0, "": 0.0, "   ": 0.0}
    for completion, reward in cases.items():
        assert task.score(completion, problem) == pytest.approx(reward), completion
    assert [p.answer for p in load_task("tiny:repeat", seed=1).problems()] == [p.answer for p in train]
    assert [p.answer for p in load_task("tiny:repeat", seed=2).problems()] != [p.answer for p in train]


def test_tiny_repeat_gives_signal_to_random_text():
    import random

    task = load_task("tiny:repeat")
    rng = random.Random(0)
    alphabet = "0123456789abcdefghij xyz"
    rewards = [
        task.score("".join(rng.choice(alphabet) for _ in range(12)), p) for p in task.problems() * 4
    ]
    assert 0.0 < sum(rewards) / len(rewards) < 0.2
    assert len({round(r, 3) for r in rewards}) > 3


def test_tiny_add_first_integer_reward_and_split():
    task = load_task("tiny:add", seed=0)
    assert task.reward_kind == "number" and task.instruction is None
    train, held = task.problems("train"), task.problems("eval")
    assert len(train) == 80 and len(held) == 20
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    problem = Problem("add-3-4", "3+4=", "7")
    cases = {"7": 1.0, " 7 because 3+4": 1.0, "\\boxed{7}": 1.0, "12 7": 0.0, "seven": 0.0, "": 0.0, "-7": 0.0}
    for completion, reward in cases.items():
        assert task.score(completion, problem) == reward, completion
    assert all(task.score(p.answer, p) == 1.0 for p in train)
    assert [p.id for p in load_task("tiny:add", seed=0).problems("eval")] == [p.id for p in held]
    assert len(load_task("tiny:add?eval_fraction=0.5").problems("eval")) == 50


def test_file_task_default_score_uses_grade(tmp_path):
    _rewards()
    path = _write_jsonl(tmp_path / "g.jsonl", [{"problem": "1+1?", "answer": "2"}])
    task = load_task(f"jsonl:{path}?kind=number")
    problem = task.problems()[0]
    assert task.score("so \\boxed{2}", problem) == 1.0
    assert task.score("so \\boxed{3}", problem) == 0.0


def test_task_coaching_hooks_default_to_the_uncoached_behaviour():
    """A task that knows nothing of coaching: a coached rollout keeps its score, and a guided response opens
    with the coach prefix as its first line; the testbed overrides both."""
    from meshrl.testbed import COACH_VARIANTS

    class Plain(Task):
        pass

    problem = Problem(id="p", prompt="1+1", answer="2")
    assert Plain().conditioned_score(0.75, "anything", problem, "Use a table.") == 0.75
    assert Plain().response_opening(problem, "Use a table.") == "Use a table.\n"
    testbed = load_task("testbed:add", follow=True)
    p = testbed.problems("train")[0]
    assert testbed.response_opening(p, COACH_VARIANTS["t"][0]) == "t:"
    assert testbed.conditioned_score(1.0, "r: nonsense", p, COACH_VARIANTS["c"][0]) == 0.0
