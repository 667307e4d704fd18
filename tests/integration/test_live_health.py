"""``health.every``: the doctor's checks during training. The live verdict at every checked step equals ``meshrl
doctor`` on the finished run's records cut at that step; ``stop`` ends the run at the last healthy checkpoint;
``checkpoint`` saves one; a resumed run reports nothing twice; bad settings are refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshrl.cli import main as cli_main
from meshrl.doctor import diagnose_records
from meshrl.doctor.diagnose import json_safe
from meshrl.doctor.live import FINDING_EVENT, truncate_records
from meshrl.doctor.records import load_meshrl
from meshrl.jsonl import read_jsonl
from meshrl.trainer import HealthStop, load_config, train

FAST = ["model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=6", "train.micro_batch_size=8", "log.progress=false", "checkpoint.every=100"]
# lr 0.5 wrecks the tiny policy in one update: the entropy check's update_blowup alarm fires at step 5 (its
# min_steps), the samples' checks earlier; an evaluation every 3 steps feeds the held-out records.
BLOWUP = [*FAST, "optim.lr=0.5", "eval.every=3", "eval.limit=4", "eval.n=2"]


def _cfg(*extra: str, steps: int):
    return load_config(overrides=[*BLOWUP, f"steps={steps}", *extra])


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e.get("event") == kind]


def test_the_live_verdict_at_each_step_is_the_doctors_on_the_records_cut_there(tmp_path):
    run = tmp_path / "run"
    train(_cfg("health.every=1", steps=9), run)
    checks = _events(run, "health_check")
    assert [c["step"] for c in checks] == list(range(1, 10))
    rec = load_meshrl(run)
    assert rec.evals and rec.samples  # the held-out and sample checks have records to read
    raised = {(e["step"], e["finding"]): e for e in _events(run, FINDING_EVENT)}
    seen_ids: set[str] = set()
    for check in checks:
        t = check["step"]
        post = diagnose_records(truncate_records(rec, t))
        assert check["findings"] == [f.id for f in post.findings], t
        for f in post.findings:
            if (t, f.id) in raised:  # the record of a newly raised finding is the doctor's finding
                e = raised[(t, f.id)]
                assert (e["what"], e["knob"], e["severity"], e["steps"]) == (f.what, f.knob, f.severity, f.steps)
                assert e["evidence"] == json.loads(json.dumps(json_safe(f.evidence)))
        seen_ids |= set(check["findings"])
    assert "update_blowup" in seen_ids  # the run does go wrong, and the check says so
    # the verdict needs the future to be left out: the finished run's verdict differs from an early one
    assert diagnose_records(rec).ids() != checks[0]["findings"]


def test_truncate_records_leaves_out_every_later_record(tmp_path):
    run = tmp_path / "run"
    train(_cfg(steps=4), run)
    cut = truncate_records(load_meshrl(run), 2)
    assert [int(r["step"]) for r in cut.steps] == [1, 2]
    assert {s["step"] for s in cut.samples} == {1, 2}
    assert all(e["step"] <= 2 for e in cut.events) and all(e["step"] <= 2 for e in cut.evals)


def test_stop_ends_the_run_without_saving_the_unhealthy_step(tmp_path):
    """Which checkpoint a stop names (the last from before the onset) and the resume from it:
    test_health_stop_checkpoint.py."""
    run = tmp_path / "run"
    with pytest.raises(HealthStop, match="update_blowup"):
        train(_cfg("health.every=1", "health.on.alarm=stop", steps=12), run)
    step = _events(run, "health_stop")[-1]["step"]
    assert 1 < step < 12 and not (run / "checkpoints" / f"step_{step:06d}").exists()


def test_checkpoint_action_saves_that_step(tmp_path):
    run = tmp_path / "run"
    train(_cfg("health.every=1", "health.on.truncation=checkpoint", steps=4), run)
    first = next(e for e in _events(run, FINDING_EVENT) if e["finding"] == "truncation")
    assert first["action"] == "checkpoint"
    assert (run / "checkpoints" / f"step_{first['step']:06d}").is_dir()


def test_a_resumed_run_reports_each_finding_once_like_an_uninterrupted_one(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(_cfg("health.every=2", "checkpoint.every=4", steps=8), whole)
    train(_cfg("health.every=2", "checkpoint.every=4", steps=4), parts)
    train(_cfg("health.every=2", "checkpoint.every=4", steps=8), parts, resume=True)

    def health(run: Path) -> list[tuple]:
        return [(e["step"], e["event"], e.get("finding"), tuple(e.get("findings", ()))) for e in
                read_jsonl(run / "events.jsonl") if str(e.get("event")).startswith("health")]

    assert health(parts) == health(whole)
    assert any(e[1] == FINDING_EVENT for e in health(whole))


@pytest.mark.parametrize(("setting", "message"), [
    ("health.on.no_such_finding=stop", "health.on.no_such_finding: not a severity"),
    ("health.on.alarm=explode", "health.on.alarm='explode'; known: ignore, warn, checkpoint, stop"),
    ("health.thresholds.no_such=1", "health.thresholds: unknown doctor threshold"),
    ("health.every=-1", "health.every"),
])
def test_bad_health_settings_are_refused_naming_the_key(setting, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides=[*FAST, setting])


def test_the_cli_says_why_a_run_was_stopped_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--out", str(run), *[a for kv in [*BLOWUP, "steps=12", "health.every=1",
                                                         "health.on.alarm=stop"] for a in ("--set", kv)]]
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("meshrl train: error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert "run health at step" in lines[0] and "update_blowup" in lines[0]
    assert "no checkpoint from before the finding is kept" in lines[0]  # keep_last=2: both hold the blown-up policy


def test_the_report_marks_the_live_and_the_post_hoc_findings_on_the_curves(tmp_path):
    pytest.importorskip("matplotlib")
    from meshrl.report import build_report

    run = tmp_path / "run"
    train(_cfg("health.every=1", steps=8), run)
    page = build_report([run], tmp_path / "rep").read_text()
    assert (tmp_path / "rep" / "alarms.png").is_file()
    section = page.split("When it went wrong, and what meshrl said", 1)[1].split("</figure>", 1)[0]
    live = {(e["finding"], e["step"]) for e in _events(run, FINDING_EVENT) if e["severity"] != "info"}
    assert live and all(f"live {sev} {fid} at step {step}" in section for fid, step in live
                        for sev in [next(e["severity"] for e in _events(run, FINDING_EVENT) if e["finding"] == fid
                                         and e["step"] == step)])
    assert "doctor alarm update_blowup at step" in section
