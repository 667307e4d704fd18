"""A JSON ``\\ud800`` escape (a lone UTF-16 surrogate) is valid JSON but not text: a task file holding one is
refused in one line naming file, line and field, in train and in eval, instead of a tokenizer TypeError."""

from __future__ import annotations

import pytest

from meshrl.cli import main as cli_main
from meshrl.tasks import load_task


@pytest.fixture()
def surrogate_file(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text('{"problem": "What is 1+1?", "answer": "2"}\n'
                    '{"problem": "What is 2+2? \\ud800", "answer": "4"}\n')
    return path


def test_the_loader_names_file_line_and_field(surrogate_file):
    with pytest.raises(ValueError, match=r"odd\.jsonl, line 2: field 'problem' holds a lone surrogate"):
        load_task(f"jsonl:{surrogate_file}").problems("all")


@pytest.mark.parametrize("command", ["train", "eval"])
def test_train_and_eval_refuse_in_one_line(surrogate_file, tmp_path, capsys, command):
    args = {"train": ["train", "--model", "tiny", "--task", f"jsonl:{surrogate_file}", "--steps", "1", "--out",
                      str(tmp_path / "run"), "--no-progress"],
            "eval": ["eval", "--model", "tiny", "--data", f"jsonl:{surrogate_file}", "--n", "1", "--out",
                     str(tmp_path / "ev"), "--no-progress"]}[command]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "line 2: field 'problem' holds a lone surrogate" in err and "Traceback" not in err
