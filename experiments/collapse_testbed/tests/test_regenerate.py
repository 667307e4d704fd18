"""Every committed table regenerates byte for byte from the committed data (README.md, one command per result)."""

from __future__ import annotations

import gzip
import json

import pytest

from experiments.collapse_testbed.regenerate import COMMITTED, DATA, PERSISTENCE, STALENESS, regenerate


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "second" else n
                                  for n in [*COMMITTED, *PERSISTENCE, *STALENESS]])
def test_committed_table_regenerates_byte_identically(name, tmp_path):
    new, committed = regenerate(name, tmp_path)
    assert new == committed


def test_a_pack_summarizes_to_its_own_results(tmp_path):
    """Beyond the table: the summary of the audit pack's runs is the results.json the pack was made with (up to
    the absolute run directories, which name the machine it ran on)."""
    regenerate("audit", tmp_path)
    with gzip.open(DATA / "testbed_audit.json.gz", "rt") as fh:
        packed = json.loads(json.load(fh)["results.json"])
    again = json.loads((tmp_path / "audit" / "results.json").read_text())
    for res in (packed, again):
        for run in res["warning"]["runs"]:
            run.pop("dir")
    assert again == packed


def test_tables_from_refuses_a_file_without_results(tmp_path, capsys):
    from experiments.collapse_testbed.cli import main

    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"runs/grpo/seed_0/metrics.jsonl": ""}))
    assert main(["--tables-from", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "holds no experiment results" in capsys.readouterr().err
