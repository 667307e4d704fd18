"""``meshrl doctor`` on damaged foreign logs: a one-line error naming the file (and field), or a counted skip."""

from __future__ import annotations

import json

import pytest

from meshrl.cli import main
from meshrl.doctor import diagnose

GOOD_ROW = {"step": 1, "reward": 0.5, "loss": 0.1, "grad_norm": 1.0}


def _trl_dir(tmp_path, text: str):
    run = tmp_path / "trl_out"
    run.mkdir()
    (run / "trainer_state.json").write_text(text)
    return run


@pytest.mark.parametrize(("state", "names"), [
    ({"log_history": None, "max_steps": 3}, "field 'log_history' must be a list"),
    ({"log_history": "x"}, "field 'log_history' must be a list"),
    ([GOOD_ROW], "expected a JSON object"),
])
def test_bad_trainer_state_shape_is_one_line_naming_file_and_field(tmp_path, capsys, state, names):
    run = _trl_dir(tmp_path, json.dumps(state))
    assert main(["doctor", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(run / "trainer_state.json") in err and names in err


@pytest.mark.parametrize("text", ["{not json", "\ufeff", '{"log_history": [' + "1" * 5000 + "]}"])
def test_trainer_state_that_is_not_json_names_the_file(tmp_path, capsys, text):
    run = _trl_dir(tmp_path, text)
    assert main(["doctor", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(run / "trainer_state.json") in err and "not valid JSON" in err


def test_non_object_log_entries_are_skipped_and_counted(tmp_path):
    history = [1, "two", None, [3], *({**GOOD_ROW, "step": s} for s in range(1, 6))]
    run = _trl_dir(tmp_path, json.dumps({"log_history": history}))
    diag = diagnose(run)
    assert diag.steps_logged == 5
    assert any("skipped 4 log_history" in n and "entry 0" in n for n in diag.notes), diag.notes


def test_400_digit_metric_value_is_read_as_infinite(tmp_path, capsys):
    history = [{**GOOD_ROW, "step": s} for s in range(1, 6)]
    history[2]["grad_norm"] = int("9" * 400)
    history[3]["loss"] = -int("9" * 400)
    run = _trl_dir(tmp_path, json.dumps({"log_history": history}))
    assert main(["doctor", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "nonfinite" in [f["id"] for f in out["findings"]]


def test_bad_training_args_are_noted_not_fatal(tmp_path):
    run = _trl_dir(tmp_path, json.dumps({"log_history": [{**GOOD_ROW, "step": s} for s in range(1, 4)]}))
    (run / "training_args.json").write_text(json.dumps({"num_generations": "eight", "learning_rate": 1e-6,
                                                        "max_completion_length": int("9" * 400)}))
    diag = diagnose(run)
    assert any("'num_generations' is not a finite number" in n for n in diag.notes)
    assert any("'max_completion_length' is not a finite number" in n for n in diag.notes)
    (run / "training_args.json").write_text("[1, 2]")
    assert any("expected a JSON object of training arguments" in n for n in diagnose(run).notes)


def test_a_verl_or_meshrl_log_line_over_the_int_limit_is_a_skipped_line(tmp_path):
    from meshrl.doctor.records import read_jsonl

    log = tmp_path / "m.jsonl"
    log.write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n" + '{"step": 2, "x": ' + "7" * 5000 + "}\n")
    notes: list[str] = []
    assert [r["step"] for r in read_jsonl(log, notes)] == [1]
    assert notes == ["m.jsonl: skipped 1 unreadable line(s)"]


def test_a_verl_log_with_a_damaged_first_line_is_still_recognised(tmp_path):
    log = tmp_path / "verl.jsonl"
    rows = [{"step": s, "data": {"critic/score/mean": 0.5, "actor/entropy": 1.0}} for s in range(1, 6)]
    log.write_text("garbage\n" + json.dumps({"step": 0, "data": [1, 2]}) + "\n"
                   + "".join(json.dumps(r) + "\n" for r in rows))
    diag = diagnose(log)
    assert diag.engine == "verl" and diag.steps_logged == 5
    assert any("skipped 1 unreadable line" in n for n in diag.notes)


def test_a_meshrl_config_that_is_not_utf8_is_a_note(tmp_path):
    (tmp_path / "config.yaml").write_bytes(b"\xff\xfe\x00steps: 3\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n"
                                                    for s in range(1, 4)))
    diag = diagnose(tmp_path)
    assert diag.steps_logged == 3 and "config.yaml unreadable (UnicodeDecodeError)" in diag.notes


def test_a_state_with_only_bad_entries_says_why_nothing_is_left(tmp_path, capsys):
    run = _trl_dir(tmp_path, json.dumps({"log_history": [1, 2, "x"]}))
    assert main(["doctor", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no per-step metrics found (trl run; trainer_state.json: skipped 3 log_history" in err
