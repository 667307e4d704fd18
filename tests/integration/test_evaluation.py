"""meshrl eval: files written, pass@k/mean@k from samples, resume, run directories as models."""

from __future__ import annotations

import json
import math

import pytest

from meshrl.cli import main as cli_main
from meshrl.evaluation import EvalConfig, run_eval, summarize
from meshrl.jsonl import read_jsonl
from meshrl.trainer import load_config, train


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
    (part / "eval_provenance.json").write_text((tmp_path / "full" / "eval_provenance.json").read_text())
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


# --- reward kinds: eval grades as training did ------------------------------------------------------------

def _sum_file(tmp_path):
    f = tmp_path / "sums.jsonl"
    rows = [{"id": f"s{a}{b}", "problem": f"What is {a}+{b}? Answer with just the number.", "answer": a + b}
            for a in range(3) for b in range(3)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_eval_follows_the_task_kind_last_number(tmp_path):
    from meshrl.rewards import grade
    from meshrl.rewards.extract import extract_last_number
    from meshrl.tasks import LAST_NUMBER_INSTRUCTION

    f = _sum_file(tmp_path)
    s = run_eval(EvalConfig(model="tiny", data=f"jsonl:{f}?kind=last_number", n=2, max_new_tokens=6), tmp_path / "ev",
                 progress=False)
    assert s["reward_kind"] == "last_number" and s["instruction"] == LAST_NUMBER_INSTRUCTION
    rows = read_jsonl(tmp_path / "ev" / "eval_samples.jsonl")
    assert len(rows) == 18
    for r in rows:
        assert r["extracted"] == extract_last_number(r["completion"])
        assert r["score"] == grade(r["completion"], r["reference"], "last_number")


def test_eval_kind_flag_overrides_the_task_kind(tmp_path, capsys):
    f = _sum_file(tmp_path)
    out = tmp_path / "ev"
    rc = cli_main(["eval", "--model", "tiny", "--data", f"jsonl:{f}", "--kind", "last_number", "--n", "1",
                   "--max-new-tokens", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "eval.json").read_text())
    assert summary["reward_kind"] == "last_number" and summary["config"]["kind"] == "last_number"
    rc = cli_main(["eval", "--model", "tiny", "--data", "tiny:add", "--kind", "last_number", "--out", str(out)])
    assert rc == 2 and "own scorer" in capsys.readouterr().err


def test_training_and_eval_agree_on_last_number_and_a_mismatch_is_named(tmp_path, caplog):
    import yaml

    from meshrl.tasks import LAST_NUMBER_INSTRUCTION

    f = _sum_file(tmp_path)
    spec = f"jsonl:{f}?kind=last_number"
    cfg = load_config(overrides=["model=tiny", f"task={spec}", "steps=1", "log.progress=false",
                                 "log.samples_per_step=-1", "rollout.max_new_tokens=4", "rollout.prompts_per_step=3",
                                 "rollout.group_size=2", "train.update_workers=1"])
    train(cfg, tmp_path / "run")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["resolved_task"] == {"name": f"jsonl:{f}", "reward_kind": "last_number",
                                      "instruction": LAST_NUMBER_INSTRUCTION}
    # Every training reward equals the score eval's grader gives the same completion.
    from meshrl.tasks import load_task

    task = load_task(spec)
    by_id = {p.id: p for p in task.problems("all")}
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert len(samples) == 6
    assert all(task.score(r["completion"], by_id[r["problem_id"]]) == r["score"] for r in samples)
    # Evaluating that run on the file without kind= grades with 'exact': said aloud, with the fix.
    with caplog.at_level("WARNING", logger="meshrl"):
        run_eval(EvalConfig(model=str(tmp_path / "run"), data=f"jsonl:{f}", n=1, limit=2, max_new_tokens=2),
                 tmp_path / "ev", progress=False)
    assert any("trained with reward kind 'last_number'" in r.getMessage() and "--kind last_number" in r.getMessage()
               for r in caplog.records)
    # Following that advice (--kind) grades as in training, but the prompts still ask for a \boxed{} answer
    # (with_kind changes grading only): said aloud too; the training spec itself raises neither warning.
    caplog.clear()
    with caplog.at_level("WARNING", logger="meshrl"):
        run_eval(EvalConfig(model=str(tmp_path / "run"), data=f"jsonl:{f}", kind="last_number", n=1, limit=2,
                            max_new_tokens=2), tmp_path / "ev2", progress=False)
    warned = [r.getMessage() for r in caplog.records if "was trained" in r.getMessage()]
    assert len(warned) == 1 and LAST_NUMBER_INSTRUCTION in warned[0] and "instruction" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="meshrl"):
        run_eval(EvalConfig(model=str(tmp_path / "run"), data=spec, n=1, limit=2, max_new_tokens=2),
                 tmp_path / "ev3", progress=False)
    assert not [r for r in caplog.records if "was trained" in r.getMessage()]
