"""meshrl sweep runs: sequential resumable runs, command lines that train, budget parity (grid expansion and a bad
arm: tests/unit/test_sweep.py)."""

from __future__ import annotations

import json
import shlex

from meshrl.cli import main as cli_main
from meshrl.trainer.sweep import load_sweep, run_sweep


def test_print_commands_are_runnable_train_lines(sweep_grid, capsys):
    assert cli_main(["sweep", str(sweep_grid), "--print-commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6
    argv = shlex.split(lines[2])
    assert argv[:2] == ["meshrl", "train"] and "mesh.mu=0.0" in argv and "recipe=mesh" in argv
    assert cli_main(argv[1:]) == 0  # the printed line itself trains


def test_run_resume_and_parity(sweep_grid, tmp_path):
    summary = run_sweep(load_sweep(sweep_grid))
    assert summary["budget_parity"] is True
    assert all(r["seeds_done"] == 2 and r["rollouts_per_seed"] == [16.0, 16.0] for r in summary["arms"])
    before = (tmp_path / "runs" / "grpo" / "seed_0" / "metrics.jsonl").read_text()
    run_sweep(load_sweep(sweep_grid))  # everything finished: nothing reruns
    assert (tmp_path / "runs" / "grpo" / "seed_0" / "metrics.jsonl").read_text() == before
    assert json.loads((tmp_path / "runs" / "sweep_summary.json").read_text())["budget_parity"]


def test_parity_violation_is_reported(sweep_grid, tmp_path, caplog):
    path = tmp_path / "g.yaml"
    path.write_text(sweep_grid.read_text().replace(str(tmp_path / "runs"), str(tmp_path / "r"))
                    .replace("grid: {mesh.mu: [0.0, 0.1]}", "set: {mesh.budget: per_prefix}"))
    summary = run_sweep(load_sweep(path))
    assert summary["budget_parity"] is False
    assert "BUDGET PARITY VIOLATED" in caplog.text
