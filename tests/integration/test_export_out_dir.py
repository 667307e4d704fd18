"""`meshrl export model|trl|verl --out`: an OUT that is a file, or lies under one, and `export trl --limit` below 1
are refused in one line naming the option (never a traceback from mkdir, never "all but the last")."""

from __future__ import annotations

import pytest

from meshrl.cli import main as cli_main
from meshrl.runs import check_out_dir


@pytest.fixture()
def a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("the user's file\n")
    return path


@pytest.mark.parametrize("under", [False, True])
def test_check_out_dir_refuses_a_file_or_a_path_under_one(a_file, under):
    out = a_file / "export" / "x" if under else a_file
    with pytest.raises(ValueError, match=r"--out .*is a file, not a directory"):
        check_out_dir(out)
    assert a_file.read_text() == "the user's file\n"


def test_check_out_dir_accepts_new_and_existing_directories(tmp_path):
    assert check_out_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert check_out_dir(tmp_path) == tmp_path


@pytest.mark.parametrize("target", ["model", "trl", "verl"])
@pytest.mark.parametrize("under", [False, True])
def test_every_exporter_refuses_an_out_that_is_a_file(target, under, a_file, tmp_path, capsys):
    out = str(a_file / "sub" if under else a_file)
    prefixes = tmp_path / "prefixes.jsonl"
    prefixes.write_text("")
    args = {"model": ["export", "model", str(tmp_path), "--out", out],
            "trl": ["export", "trl", "--task", "tiny:add", "--prefixes", str(prefixes), "--out", out],
            "verl": ["export", "verl", "--task", "tiny:add", "--out", out]}[target]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "is a file, not a directory" in err and "Traceback" not in err
    assert a_file.read_text() == "the user's file\n"


@pytest.mark.parametrize("limit", ["-1", "0"])
def test_export_trl_refuses_a_limit_below_one(limit, tmp_path, capsys):
    prefixes = tmp_path / "prefixes.jsonl"
    prefixes.write_text("")
    assert cli_main(["export", "trl", "--task", "tiny:add", "--prefixes", str(prefixes), "--out",
                     str(tmp_path / "out"), "--limit", limit]) == 2
    assert "--limit must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
