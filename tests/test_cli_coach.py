"""meshrl coach with the local-model (hf) backend: the plumbing from a transformers model to the cache."""

from __future__ import annotations

import json

from meshrl.cli import main as cli_main
from meshrl.trainer.runlog import read_jsonl


def test_hf_backend_runs_the_local_model_and_records_rejects(tmp_path, capsys):
    out = tmp_path / "prefixes.jsonl"
    rc = cli_main(["coach", "--task", "tiny:add", "--backend", "hf", "--model", "tiny", "--limit", "2",
                   "--max-attempts", "2", "--max-new-tokens", "12", "--out", str(out)])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    # A random tiny model cannot write valid JSON strategies: every query is tried twice, then rejected.
    assert summary["requests"] == 4 and summary["rejected"] == 2 and summary["generated"] == 0
    rejects = read_jsonl(tmp_path / "prefixes.rejects.jsonl")
    assert len(rejects) == 2 and all(r.get("reasons") or r.get("attempts") for r in rejects)


def test_coach_backend_argument_errors(tmp_path, capsys):
    assert cli_main(["coach", "--task", "tiny:add", "--backend", "openai", "--out", str(tmp_path / "p")]) == 2
    assert "needs --model" in capsys.readouterr().err
    assert cli_main(["coach", "--task", "tiny:add", "--backend", "openai", "--model", "m",
                     "--out", str(tmp_path / "p")]) == 2
    assert "--base-url" in capsys.readouterr().err
