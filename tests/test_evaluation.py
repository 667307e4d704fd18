"""meshrl eval: files written, pass@k/mean@k from samples, resume, run directories as models."""

from __future__ import annotations

import json
import math

import pytest

from meshrl.cli import main as cli_main
from meshrl.evaluation import EvalConfig, run_eval, summarize
from meshrl.trainer import load_config, train
from meshrl.trainer.runlog import read_jsonl


def test_summarize_matches_hand_computed_pass_and_mean_at_k():
    rows = [{"problem_id": "a", "sample": i, "correct": c} for i, c in enumerate([1, 0, 0, 1])]
    rows += [{"problem_id": "b", "sample": i, "correct": 0} for i in range(4)]
    s = summarize(rows, [1, 2])["overall"]
    # a: n=4, c=2 -> pass@1 = 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 5/6; b: 0. Means over 2 problems.
    assert s["pass@1"] == pytest.approx(0.25)
    assert s["pass@2"] == pytest.approx(5 / 12)
    # mean@2 uses the first 2 samples: a -> 0.5, b -> 0
    assert s["mean@2"] == pytest.approx(0.25)
    assert s["problems"] == 2


def test_acceptance_command_writes_both_files(tmp_path, capsys):
    from meshrl.tasks import data_dir

    try:
        data_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "ev"
    rc = cli_main(["eval", "--model", "tiny", "--data", "math500", "--n", "2", "--k", "1,2", "--limit", "5",
                   "--max-new-tokens", "8", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = read_jsonl(out / "eval_samples.jsonl")
    assert len(rows) == 10
    assert {"problem_id", "completion", "extracted", "reference", "score", "correct"} <= set(rows[0])
    summary = json.loads((out / "eval.json").read_text())
    assert summary["overall"]["problems"] == 5
    assert set(summary["overall"]) >= {"pass@1", "pass@2", "mean@1", "mean@2"}
    assert "pass@2" in capsys.readouterr().out


def test_bad_k_is_rejected():
    with pytest.raises(ValueError, match="between 1 and --n"):
        EvalConfig(model="tiny", data="tiny:add", n=2, ks=[4]).validate()


def test_resume_gives_the_same_samples(tmp_path, monkeypatch):
    cfg = EvalConfig(model="tiny", data="tiny:add", n=2, ks=[1, 2], limit=12, max_new_tokens=3, chunk_size=4)
    full = run_eval(cfg, tmp_path / "full", progress=False)
    # Interrupt after the first chunk: keep only its rows plus half a problem, then resume.
    rows = read_jsonl(tmp_path / "full" / "eval_samples.jsonl")
    part = tmp_path / "part"
    part.mkdir()
    (part / "eval_samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:9]))
    resumed = run_eval(cfg, part, progress=False)
    assert resumed["overall"] == full["overall"]
    key = lambda r: (r["problem_id"], r["sample"])  # noqa: E731
    assert sorted(read_jsonl(part / "eval_samples.jsonl"), key=key) == sorted(rows, key=key)


def test_run_directory_checkpoint_is_a_model(tmp_path):
    cfg = load_config(overrides=["model=tiny", "task=tiny:add", "steps=1", "log.progress=false",
                                 "rollout.max_new_tokens=3", "rollout.prompts_per_step=2", "rollout.group_size=2"])
    train(cfg, tmp_path / "run")
    s = run_eval(EvalConfig(model=str(tmp_path / "run"), data="tiny:add", split="eval", n=1, ks=[1], limit=4,
                            max_new_tokens=3), tmp_path / "ev", progress=False)
    assert "step 1" in s["model_loaded"]
    assert math.isfinite(s["overall"]["pass@1"])


def _fake_eval(path, data, per_problem):
    path.mkdir(parents=True)
    (path / "eval.json").write_text(json.dumps({"config": {"data": data}, "per_problem": per_problem}))


def test_compare_identical_models_gives_no_difference(tmp_path, capsys):
    pp = {f"p{i}": {"n": 4, "c": i % 5} for i in range(30)}
    _fake_eval(tmp_path / "a", "bench", pp)
    _fake_eval(tmp_path / "b", "bench", pp)
    assert cli_main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "--n-boot", "500"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["diff"] == 0 and row["ci_low"] <= 0 <= row["ci_high"] and not row["significant"]


def test_compare_folders_of_benchmarks_pairs_by_id_and_corrects(tmp_path, capsys):
    better = {f"p{i}": {"n": 4, "c": 4} for i in range(40)}
    worse = {f"p{i}": {"n": 4, "c": 0 if i % 4 else 4} for i in range(40)}
    same = {f"q{i}": {"n": 4, "c": 2} for i in range(10)}
    _fake_eval(tmp_path / "A" / "math", "m", better)
    _fake_eval(tmp_path / "A" / "gsm", "g", same)
    _fake_eval(tmp_path / "B" / "math", "m", {**worse, "extra": {"n": 4, "c": 0}})
    _fake_eval(tmp_path / "B" / "gsm", "g", same)
    assert cli_main(["compare", str(tmp_path / "A"), str(tmp_path / "B"), "--json", "--n-boot", "2000",
                     "--metric", "pass@2"]) == 0
    rows = {r["benchmark"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["math"]["n_problems"] == 40 and rows["math"]["significant"] and rows["math"]["diff"] > 0.5
    assert not rows["gsm"]["significant"]


def test_compare_rejects_non_eval_dirs(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert cli_main(["compare", str(tmp_path / "x"), str(tmp_path / "x")]) == 2
    assert "neither an eval directory" in capsys.readouterr().err
