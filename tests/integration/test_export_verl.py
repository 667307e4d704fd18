"""`meshrl export verl` without verl: the parquet layout, the prefix lookup, bad input, the reward module."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

pq = pytest.importorskip("pyarrow.parquet")

from meshrl.export.verl import add_export_parser, export_verl  # noqa: E402
from meshrl.mesh import RuleCoach, generate_prefixes, wrap_prefix  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402

TASK = "tiny:add"


@pytest.fixture
def prefix_file(tmp_path):
    task = load_task(TASK)
    problems = task.problems("train")
    by_id = {p.id: p for p in problems}
    path = tmp_path / "prefixes.jsonl"
    generate_prefixes([{"id": p.id, "problem": p.prompt, "answer": p.answer} for p in problems],
                      RuleCoach(lambda q: task.coach_strategies(by_id[q["id"]])), m=4, out_path=path)
    return path, task, problems


def _load_module(path):
    spec = importlib.util.spec_from_file_location("exported_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_row_per_query_and_prefix_with_ids(tmp_path, prefix_file):
    path, task, problems = prefix_file
    summary = export_verl(TASK, tmp_path / "out", prefixes=path, m=3)
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert summary["rows"] == len(rows) == 3 * len(problems)
    first, third = rows[0], rows[2]
    assert first["extra_info"] == {"query_id": problems[0].id, "strategy_id": 0, "num_strategies": 3,
                                   "split": "train", "index": 0}
    assert third["extra_info"]["strategy_id"] == 2 and third["extra_info"]["query_id"] == problems[0].id
    assert rows[3]["extra_info"]["query_id"] == problems[1].id
    # System message: the task's own rule strategy k, wrapped; user message: the question with its instruction.
    strategies = task.coach_strategies(problems[0])
    assert [m["role"] for m in third["prompt"]] == ["system", "user"]
    assert third["prompt"][0]["content"] == wrap_prefix(strategies[2], "system")
    assert third["prompt"][1]["content"] == task.format_prompt(problems[0])
    assert first["reward_model"] == {"style": "rule", "ground_truth": problems[0].answer}
    assert first["data_source"] == "meshrl/tiny:add"
    val = pq.read_table(tmp_path / "out" / "val.parquet").to_pylist()
    assert len(val) == len(task.problems("eval"))
    assert {r["extra_info"]["strategy_id"] for r in val} == {-1} and val[0]["prompt"][0]["role"] == "user"
    written = json.loads((tmp_path / "out" / "export.json").read_text())
    assert f"reward.custom_reward_function.path={summary['reward_module']}" in written["verl_overrides"]


def test_plain_template_and_bare_rows(tmp_path, prefix_file):
    path, task, problems = prefix_file
    export_verl(TASK, tmp_path / "plain", prefixes=path, m=2, template="plain", val_split=None)
    rows = pq.read_table(tmp_path / "plain" / "train.parquet").to_pylist()
    assert rows[1]["prompt"][0]["content"] == task.coach_strategies(problems[0])[1]
    assert not (tmp_path / "plain" / "val.parquet").exists()
    export_verl(TASK, tmp_path / "bare")
    bare = pq.read_table(tmp_path / "bare" / "train.parquet").to_pylist()
    assert len(bare) == len(problems) and {r["extra_info"]["strategy_id"] for r in bare} == {-1}
    assert {r["extra_info"]["num_strategies"] for r in bare} == {0}


def test_prefix_file_of_another_task_is_an_error_naming_it(tmp_path, prefix_file):
    path, _, _ = prefix_file
    with pytest.raises(ValueError, match=r"prefixes\.jsonl: .*have no 4 prefixes"):
        export_verl("tiny:repeat", tmp_path / "x", prefixes=path)
    with pytest.raises(ValueError, match="have no 5 prefixes"):
        export_verl(TASK, tmp_path / "x", prefixes=path, m=5)
    with pytest.raises(ValueError, match="prefix file not found"):
        export_verl(TASK, tmp_path / "x", prefixes=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="--m must be"):
        export_verl(TASK, tmp_path / "x", prefixes=path, m=0)


def test_reward_module_scores_a_known_completion(tmp_path):
    summary = export_verl(TASK, tmp_path / "out")
    row = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()[5]
    compute_score = _load_module(summary["reward_module"]).compute_score
    answer = row["reward_model"]["ground_truth"]
    kwargs = {"data_source": row["data_source"], "ground_truth": answer, "extra_info": dict(row["extra_info"])}
    assert compute_score(solution_str=answer, **kwargs) == {"score": 1.0, "acc": True}
    wrong = compute_score(solution_str=str(int(answer) + 1), **kwargs)
    assert wrong["acc"] is False and wrong["score"] < 1.0
    with pytest.raises(ValueError, match="query_id 'nope' is not a train problem"):
        compute_score(solution_str=answer, **{**kwargs, "extra_info": {"query_id": "nope", "split": "train"}})
    with pytest.raises(ValueError, match="no extra_info 'query_id'"):
        compute_score(solution_str=answer, **{**kwargs, "extra_info": {}})


def test_cli_subcommand(tmp_path, prefix_file, capsys):
    path, _, problems = prefix_file
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers(dest="target"))
    args = parser.parse_args(["verl", "--task", TASK, "--prefixes", str(path), "--out", str(tmp_path / "cli")])
    assert args.func(args) == 0
    assert f"wrote {4 * len(problems)} rows ({len(problems)} queries x 4 prefixes)" in capsys.readouterr().out


def test_meshrl_cli_and_export_import_no_verl():
    """The CLI (and the export it runs) must work where verl is not installed: nothing imports verl at import."""
    import subprocess
    import sys

    code = ("import sys, meshrl.cli, meshrl.export.verl, meshrl.integrations.verl.reward\n"
            "assert 'verl' not in sys.modules, sorted(m for m in sys.modules if m.startswith('verl'))\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_reward_module_scores_a_failing_scorer_zero_as_meshrl_does(tmp_path):
    """verl's reward worker got the task's exception (one bad completion ended the step) or its NaN; meshrl's
    trainer scores both 0, counted and logged, and clamps into [0, 1]."""
    from meshrl.integrations.verl.reward import TaskScorer

    summary = export_verl(TASK, tmp_path / "out")
    row = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()[0]
    kwargs = {"data_source": row["data_source"], "ground_truth": "", "extra_info": dict(row["extra_info"])}
    scorer = TaskScorer(summary["task"])
    task, _ = scorer.problem(row["extra_info"]["query_id"], row["extra_info"]["split"])
    outcomes = {"raise": lambda: 1 / 0, "nan": lambda: float("nan"), "big": lambda: 7.0, "good": lambda: 1.0}
    task.score = lambda completion, problem: outcomes[completion]()  # this scorer's task object only
    assert [scorer(solution_str=k, **kwargs)["score"] for k in outcomes] == [0.0, 0.0, 1.0, 1.0]

