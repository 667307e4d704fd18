"""The experiments' commands refuse bad arguments before any work: exit status 2 and one line naming the option,
as ``meshrl`` does; no experiment starts, nothing is written into ``--out``."""

from __future__ import annotations

from pathlib import Path

import pytest


def _never(*args, **kwargs):
    raise AssertionError("an experiment started on bad arguments")


def _one_line(capsys, prog: str, flag: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"{prog}: error: ") and flag in err, err
    return err


@pytest.mark.parametrize(("extra", "flag"), [
    (["--steps", "-1"], "--steps"),
    (["--steps", "0"], "--steps"),
    (["--workers", "0"], "--workers"),
    (["--ckpt-eval-every", "-3"], "--ckpt-eval-every"),
    (["--seeds", "0", "-2"], "--seeds"),
    (["--seeds", "1", "1"], "--seeds"),
    (["--unpack", "missing.json.gz"], "--unpack"),
    (["--unpack", "missing.json.gz", "--summarize-only"], "--unpack"),
    (["--tables-from", "missing.json"], "--tables-from"),
])
def test_collapse_testbed_refuses_bad_arguments_before_any_work(tmp_path, monkeypatch, capsys, extra, flag):
    import experiments.collapse_testbed.experiment as experiment
    import experiments.collapse_testbed.pack as pack
    from experiments.collapse_testbed.cli import main

    monkeypatch.setattr(experiment, "run_experiment", _never)
    monkeypatch.setattr(pack, "unpack_experiment", _never)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "exp"
    assert main(["--out", str(out), "--no-figures", "--no-progress", *extra]) == 2
    _one_line(capsys, "python -m experiments.collapse_testbed", flag)
    assert not out.exists()


@pytest.mark.parametrize(("extra", "flag"), [
    (["--steps", "-1"], "--steps"),
    (["--ckpt-every", "0"], "--ckpt-every"),
    (["--report-problems", "1"], "--report-problems"),
    (["--seeds", "-1"], "--seeds"),
    (["--seeds", "2", "2"], "--seeds"),
    (["--summarize"], "--summarize"),
])
def test_tools_testbed_refuses_bad_arguments_before_any_work(tmp_path, monkeypatch, capsys, extra, flag):
    import experiments.tools_testbed.experiment as experiment
    from experiments.tools_testbed.cli import main

    monkeypatch.setattr(experiment, "run_experiment", _never)
    monkeypatch.setattr(experiment, "summarize", _never)
    out = tmp_path / "exp"
    assert main(["--out", str(out), *extra]) == 2
    _one_line(capsys, "python -m experiments.tools_testbed", flag)
    assert not out.exists()


def test_tools_testbed_out_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    import experiments.tools_testbed.experiment as experiment
    from experiments.tools_testbed.cli import main

    monkeypatch.setattr(experiment, "run_experiment", _never)
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    assert main(["--out", str(out)]) == 2
    _one_line(capsys, "python -m experiments.tools_testbed", "--out")
    assert out.read_text() == "mine\n"


@pytest.mark.parametrize(("extra", "flag"), [
    (["--every", "0"], "--every"),
    (["--from-pack", "missing.json.gz"], "--from-pack"),
    (["--corpus", "missing_dir"], "--corpus"),
    (["--testbed-pack", "missing.json.gz"], "--testbed-pack"),
])
def test_health_corpus_refuses_bad_arguments_before_any_work(tmp_path, monkeypatch, capsys, extra, flag):
    import experiments.health_corpus.cli as cli

    for name in ("pack_corpus", "tables_from_pack", "load_corpus", "testbed_pack_runs"):
        monkeypatch.setattr(cli, name, _never)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["--out", str(out), *extra]) == 2
    _one_line(capsys, "python -m experiments.health_corpus", flag)
    assert not out.exists()


def test_health_corpus_out_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    import experiments.health_corpus.cli as cli

    monkeypatch.setattr(cli, "tables_from_pack", _never)
    pack = tmp_path / "corpus.json.gz"
    pack.write_bytes(b"")
    out: Path = tmp_path / "notes.txt"
    out.write_text("mine\n")
    assert cli.main(["--out", str(out), "--from-pack", str(pack)]) == 2
    _one_line(capsys, "python -m experiments.health_corpus", "--out")
    assert out.read_text() == "mine\n"
