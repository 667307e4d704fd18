"""A damaged ``meshrl coach`` prefix file (binary, non-string prefixes or names, a key that is not a string) is
refused in one line naming the file and the line, by `meshrl export trl`, `meshrl export verl` and every Mesh
loader (never a traceback, never a row with a non-string prefix written with exit status 0)."""

from __future__ import annotations

import json

import pytest

from meshrl.cli import main as cli_main
from meshrl.mesh import load_prefixes, query_key
from meshrl.tasks import load_task


def _records() -> list[dict]:
    return [{"key": query_key(p.prompt), "prefixes": ["count up", "carry first"], "names": ["up", "carry"]}
            for p in load_task("tiny:add", seed=0).problems("train")]


BAD = {  # record 4 (line 4) broken in each way: (change, what the message says)
    "prefix_int": ({"prefixes": ["a", 5]}, "'prefixes' item 1 must be a string, got int"),
    "prefix_null": ({"prefixes": [None, "b"]}, "'prefixes' item 0 must be a string, got nothing"),
    "prefixes_str": ({"prefixes": "ab"}, "'prefixes' must be a list of strings, got str"),
    "names_int": ({"names": 5}, "'names' must be a list of strings, got int"),
    "names_item": ({"names": ["up", {"x": 1}]}, "'names' item 1 must be a string, got dict"),
    "key_int": ({"key": 7}, "not a record with a 'key' string"),
}


@pytest.fixture(params=sorted(BAD))
def bad_file(request, tmp_path):
    change, message = BAD[request.param]
    records = _records()
    records[3] = {**records[3], **change}
    path = tmp_path / "prefixes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, message


@pytest.mark.parametrize("target", ["trl", "verl"])
def test_export_refuses_a_bad_prefix_record_naming_file_and_line(target, bad_file, tmp_path, capsys):
    path, message = bad_file
    out = tmp_path / "out"
    assert cli_main(["export", target, "--task", "tiny:add", "--prefixes", str(path), "--m", "2",
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"prefix file {path}, line 4: {message}" in err
    assert not (out / "train.jsonl").exists()


def test_the_mesh_loader_names_file_and_line(bad_file):
    path, message = bad_file
    with pytest.raises(ValueError, match=rf"prefix file .*prefixes\.jsonl, line 4: {message[:20]}"):
        load_prefixes(path)


@pytest.mark.parametrize("content", [bytes(range(256)) * 8, b"\x1f\x8b\x08\x00binary\n", b"\x00" * 64 + b"\n"])
def test_a_binary_prefix_file_names_file_and_line(content, tmp_path, capsys):
    path = tmp_path / "prefixes.jsonl"
    path.write_bytes(content)
    assert cli_main(["export", "trl", "--task", "tiny:add", "--prefixes", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"prefix file {path}, line 1: not" in err


def test_a_good_prefix_file_still_exports(tmp_path):
    path = tmp_path / "prefixes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert cli_main(["export", "trl", "--task", "tiny:add", "--prefixes", str(path), "--m", "2",
                     "--out", str(tmp_path / "o")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "o" / "train.jsonl").read_text().splitlines()]
    assert rows[0]["prefixes"] == ["count up", "carry first"] and rows[0]["strategy_names"] == ["up", "carry"]
