"""meshrl coach: the hf plumbing, exit codes, fail-fast set-up errors, credentials never written."""

from __future__ import annotations

import json

from test_mesh_coach import KEY_ENV, SECRET, good_answer, server  # noqa: F401 - server is a fixture

from meshrl.cli import main as cli_main
from meshrl.jsonl import read_jsonl


def test_hf_backend_runs_the_local_model_and_records_rejects(tmp_path, capsys):
    out = tmp_path / "prefixes.jsonl"
    rc = cli_main(["coach", "--task", "tiny:add", "--backend", "hf", "--model", "tiny", "--limit", "2",
                   "--max-attempts", "2", "--max-new-tokens", "12", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 1 and "no usable prefixes" in captured.err  # nothing usable: a failure, not rc 0
    summary = json.loads(captured.out)
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


def _coach(server, tmp_path, *extra: str, url: str | None = None) -> int:  # noqa: F811
    return cli_main(["coach", "--task", "tiny:add", "--backend", "openai", "--model", "coach-model",
                     "--base-url", url or server.base_url, "--limit", "2", "--max-attempts", "2",
                     "--api-key-env", KEY_ENV, "--timeout", "5", "--out", str(tmp_path / "p.jsonl"), *extra])


def test_missing_key_fails_fast_with_one_line(server, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert _coach(server, tmp_path) == 2
    err = capsys.readouterr().err
    assert KEY_ENV in err and len(err.strip().splitlines()) == 1 and server.requests == []


def test_all_rejected_exits_non_zero_and_good_answers_exit_zero(server, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setenv(KEY_ENV, SECRET)
    server.respond = lambda body, n: ("ok", "not json at all")
    assert _coach(server, tmp_path) == 1
    assert "no usable prefixes" in capsys.readouterr().err
    server.respond = lambda body, n: ("ok", good_answer())
    assert _coach(server, tmp_path, "--m", "4") == 0  # the rejected queries are retried and now accepted
    assert json.loads(capsys.readouterr().out)["generated"] == 2


def test_url_credentials_are_redacted_in_rejects_stderr_and_logs(server, tmp_path, monkeypatch, capsys,  # noqa: F811
                                                                  caplog):
    monkeypatch.delenv(KEY_ENV, raising=False)
    url = server.base_url.replace("http://", f"http://user:{SECRET}@")
    server.respond = lambda body, n: ("status", 401, f"denied for {url}")  # a 4xx: no retry, no backoff
    rc = cli_main(["coach", "--task", "tiny:add", "--backend", "openai", "--model", "coach-model", "--base-url", url,
                   "--limit", "1", "--max-attempts", "1", "--api-key-env", "", "--out", str(tmp_path / "p.jsonl")])
    out = capsys.readouterr()
    assert rc == 1 and server.requests
    assert SECRET not in out.out + out.err + caplog.text
    assert all(SECRET not in p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    assert f"HTTP 401 from {server.base_url}" in (tmp_path / "p.rejects.jsonl").read_text()  # credentials out
