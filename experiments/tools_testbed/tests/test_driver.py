"""The tool-use experiment driver: a run trains, is measured at its checkpoints and marked done; a finished run
is skipped, a measured step is not measured again, and a resume with other pinned settings is refused."""

from __future__ import annotations

import json

import pytest

from experiments.tools_testbed import experiment as ex


def _fake_report(share: float) -> dict:
    figures = {"n": 4, "accuracy": 0.5, "tool_share": share, "acc_tool": 1.0, "acc_direct": 0.0, "unlabelled": 0.0}
    return {"add": figures, "mul": figures, "all": figures}


@pytest.fixture()
def small(tmp_path, monkeypatch):
    """A tiny untrained model as the warm start, two-step runs, and a counting stand-in for the measurement."""
    from meshrl.models import build_tiny

    model, tok = build_tiny("tiny", seed=0)
    model.save_pretrained(tmp_path / "warm")
    tok.save_pretrained(tmp_path / "warm")
    calls: list[tuple[str, int]] = []

    def measure(model_dir, s, seed):
        calls.append((model_dir.name, seed))
        return _fake_report(0.5)

    monkeypatch.setattr(ex, "measure", measure)
    s = ex.ToolsSettings(steps=2, prompts_per_step=2, group_size=2, ckpt_every=1, seeds=(0,), arms=("grpo",),
                         report_problems=4, report_n=1, extra=("train.micro_batch_size=8",))
    return tmp_path, s, calls


def test_a_run_is_measured_marked_done_and_then_skipped(small, monkeypatch):
    tmp_path, s, calls = small
    run_dir = tmp_path / "runs" / "grpo" / "seed_0"
    result = ex.run_job("grpo", 0, run_dir, s, tmp_path / "warm")
    assert result["arm"] == "grpo" and (run_dir / "done.json").is_file()
    assert calls == [("step_000001", 0), ("step_000002", 0)]
    assert [json.loads(line)["step"] for line in (run_dir / "tool_report.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(ex.checkpoint_dirs(run_dir)) == [2]  # pruned to the last

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run must not train again")

    monkeypatch.setattr("meshrl.trainer.train", no_training)
    assert ex.run_job("grpo", 0, run_dir, s, tmp_path / "warm") == {"arm": "grpo", "seed": 0, "skipped": "done"}
    (run_dir / "done.json").unlink()  # interrupted after training: resumes, measures nothing twice
    ex.run_job("grpo", 0, run_dir, s, tmp_path / "warm")
    assert len(calls) == 2 and (run_dir / "done.json").is_file()


def test_summary_tables_and_pinned_settings(small):
    tmp_path, s, _ = small
    out = tmp_path
    ex.write_settings(out, s, tmp_path / "warm")
    (out / "warm_report.json").write_text(json.dumps({"report": _fake_report(0.5)}))
    for seed, share in ((0, 0.0), (1, 0.8)):
        run = out / "runs" / "grpo" / f"seed_{seed}"
        run.mkdir(parents=True)
        (run / "tool_report.jsonl").write_text("".join(json.dumps({"step": k, "report": _fake_report(share)}) + "\n"
                                                       for k in (1, 2)))
        (run / "done.json").write_text("{}")
    ex.write_settings(out, ex.ToolsSettings(**{**s.__dict__, "seeds": (1,)}), tmp_path / "warm")
    results = ex.summarize(out)
    assert set(results["runs"]["grpo"]) == {"0", "1"}
    table = (out / "results.md").read_text()
    assert "| grpo | 2 | 0.50 ± 0.00 | 0.50 ± 0.00 | 0.40 ± 0.57 | 0.40 ± 0.57 | 1 |" in table
    assert "| grpo | 0.50 | 0.40 | 0.40 |" in table
    with pytest.raises(ValueError, match=r"other settings \(steps=2\)"):
        ex.check_resumable(out, ex.ToolsSettings(**{**s.__dict__, "steps": 3}))
    with pytest.raises(ValueError, match=r"unknown arm\(s\) \['ppo'\]"):
        ex.ToolsSettings(arms=("ppo",))
