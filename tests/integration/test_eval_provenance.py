"""An evaluation reports only samples of what it says it evaluated: OUT records what produced its samples (the
weights' hash and every setting that decides them), and a resume reuses rows only when all of it matches;
otherwise a one-line refusal that says how to start fresh. The resume's rewrite of the samples is atomic."""

from __future__ import annotations

import json

import pytest

from meshrl import jsonl
from meshrl.cli import main as cli_main
from meshrl.evaluation.runner import EvalConfig, run_eval

BASE = dict(model="tiny", data="tiny:add", n=2, ks=[1], limit=4, max_new_tokens=3, chunk_size=2)


def test_the_same_evaluation_resumes_and_records_its_provenance(tmp_path):
    out = tmp_path / "ev"
    first = run_eval(EvalConfig(**BASE), out, progress=False)
    again = run_eval(EvalConfig(**BASE), out, progress=False)
    assert again["overall"] == first["overall"]
    recorded = json.loads((out / "eval_provenance.json").read_text())
    assert recorded["temperature"] == 1.0 and len(recorded["weights_sha256"]) == 64
    assert first["provenance"] == recorded


@pytest.mark.parametrize(("change", "named"), [
    ({"model": "tiny:small"}, "another model's weights"),
    ({"temperature": 0.7}, "temperature 1.0 there, 0.7 now"),
    ({"top_p": 0.9}, "top_p 1.0 there, 0.9 now"),
    ({"max_new_tokens": 4}, "max_new_tokens 3 there, 4 now"),
    ({"seed": 1}, "seed 0 there, 1 now"),
    ({"data": "tiny:repeat"}, "data 'tiny:add' there, 'tiny:repeat' now"),
])
def test_another_evaluation_into_the_same_out_is_refused(tmp_path, change, named):
    out = tmp_path / "ev"
    run_eval(EvalConfig(**BASE), out, progress=False)
    before = (out / "eval_samples.jsonl").read_bytes()
    with pytest.raises(ValueError, match=rf"holds samples of .*{named}.*start this evaluation afresh"):
        run_eval(EvalConfig(**{**BASE, **change}), out, progress=False)
    assert (out / "eval_samples.jsonl").read_bytes() == before


def test_two_checkpoints_of_one_run_are_told_apart(tmp_path, capsys):
    from meshrl.testing import tiny_config
    from meshrl.trainer import train

    run = tmp_path / "run"
    train(tiny_config("checkpoint.every=1", "task=tiny:add", "optim.lr=1e-2", steps=2), run)
    args = ["eval", "--data", "tiny:add", "--n", "1", "--limit", "2", "--max-new-tokens", "3", "--out",
            str(tmp_path / "ev"), "--no-progress"]
    assert cli_main([*args, "--model", str(run / "checkpoints" / "step_000001")]) == 0
    assert cli_main([*args, "--model", str(run / "checkpoints" / "step_000002")]) == 2
    err = capsys.readouterr().err
    assert "another model's weights" in err and "Traceback" not in err


def test_samples_without_a_record_are_not_reused(tmp_path):
    out = tmp_path / "ev"
    run_eval(EvalConfig(**BASE), out, progress=False)
    (out / "eval_provenance.json").unlink()
    with pytest.raises(ValueError, match=r"holds samples without a record of what produced them"):
        run_eval(EvalConfig(**BASE), out, progress=False)


def test_a_kill_inside_the_resumes_rewrite_keeps_every_finished_row(tmp_path, monkeypatch):
    out = tmp_path / "ev"
    run_eval(EvalConfig(**BASE), out, progress=False)
    path = out / "eval_samples.jsonl"
    with path.open("a") as f:  # half a problem: the resume rewrites the file without it
        f.write(json.dumps({"problem_id": "extra", "sample": 0, "completion": "", "correct": False}) + "\n")
    before = path.read_bytes()

    def killed(fd, *args, **kwargs):
        raise KeyboardInterrupt  # stands for a kill in the middle of the rewrite

    monkeypatch.setattr(jsonl.os, "fdopen", killed)
    with pytest.raises(KeyboardInterrupt):
        run_eval(EvalConfig(**BASE), out, progress=False)
    assert path.read_bytes() == before  # the old file, never a short one
