"""The run directory's record format (meshrl.jsonl, one reader and one error policy) and its small helpers."""

from __future__ import annotations

import logging

import pytest

from meshrl.jsonl import BadLines, JsonlWriter, iter_jsonl, read_jsonl, truncate_after_step
from meshrl.runs import CORRECT_AT, is_correct
from meshrl.trainer import read_run_config


def test_writer_and_reader_round_trip_and_keep_non_finite_values_visible(tmp_path):
    w = JsonlWriter(tmp_path / "m.jsonl")
    w.write({"step": 1, "loss": 0.5})
    w.write({"step": 2, "loss": float("nan")})
    w.close()
    assert read_jsonl(tmp_path / "m.jsonl") == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": "nan"}]


@pytest.mark.parametrize(("content", "message"), [
    (b'{"a": 1}\n{"a": \n{"a": 3}\n', r"m\.jsonl, line 2: not valid JSON"),
    (b'{"a": 1}\n[1, 2]\n', r"m\.jsonl, line 2: expected a JSON object, got list"),
    (b'{"a": 1}\n{"a": "\xff"}\n', r"m\.jsonl, line 2: not UTF-8 text \(byte 0xff"),
    (b'{"a": 1}\n' + b"[" * 100_000 + b"\n", r"m\.jsonl, line 2: (JSON nested too deeply|not valid JSON)"),
])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, content, message):
    path = tmp_path / "m.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_jsonl(path)


def test_skipped_lines_are_counted_and_logged_once(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"a": 1}\nnot json\n[2]\n{"a": 4}\n')
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        assert [r["a"] for r in read_jsonl(path, on_bad="skip")] == [1, 4]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "skipped 2 unreadable line(s) (first: line 2: not valid JSON" in warnings[0]
    bad = BadLines()
    assert len(list(iter_jsonl(path, on_bad="skip", skipped=bad))) == 2 and bad.count == 2


def test_a_partial_last_line_is_dropped_with_a_warning_unless_asked_to_raise(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # a kill during an append
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert "dropped a partial last line 3" in caplog.text
    with pytest.raises(ValueError, match=r"line 3: not valid JSON"):
        read_jsonl(path, partial_last="raise")
    with pytest.raises(ValueError, match=r"prefix file .*m\.jsonl, line 3"):
        read_jsonl(path, partial_last="raise", what="prefix file")


def test_a_byte_order_mark_and_blank_lines_are_ignored(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n   \n{"a": 2}\n')
    assert [n for n, _ in iter_jsonl(path)] == [1, 4]


def test_truncate_after_step_drops_later_records_and_the_partial_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "x')
    truncate_after_step(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_is_correct_is_the_one_cut():
    assert is_correct(1.0) and is_correct(1.0 - 1e-7) and not is_correct(0.999) and not is_correct(0.0)
    assert is_correct(CORRECT_AT)


def test_read_run_config_names_a_directory_without_one(tmp_path, tiny_config):
    with pytest.raises(ValueError, match="no config.yaml"):
        read_run_config(tmp_path)
    from meshrl.runs.run_dir import write_config
    from meshrl.trainer import config_reference  # noqa: F401 - the public trainer API is importable from here
    from meshrl.trainer.config import config_record

    cfg = tiny_config("recipe=dapo", "algo.clip_high=0.3")
    write_config(config_record(cfg), tmp_path)
    back = read_run_config(tmp_path)
    assert back.recipe == "dapo" and back.resolved_recipe() == cfg.resolved_recipe()
