"""meshrl sweep: grid expansion, sequential resumable runs, command lines, budget parity."""

from __future__ import annotations

import json
import shlex

import pytest

from meshrl.cli import main as cli_main
from meshrl.trainer.sweep import load_sweep, run_sweep

GRID = """
out: {out}
seeds: [0, 1]
base:
  model: tiny
  task: tiny:add
  steps: 2
  log: {{progress: false}}
  rollout: {{prompts_per_step: 2, group_size: 4, max_new_tokens: 3}}
arms:
  - name: grpo
    recipe: grpo
  - name: mesh
    recipe: mesh
    grid: {{mesh.mu: [0.0, 0.1]}}
"""


@pytest.fixture
def grid(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(GRID.format(out=tmp_path / "runs"))
    return path


def test_grid_expands_arms(grid):
    sweep = load_sweep(grid)
    assert [a.name for a in sweep.arms] == ["grpo", "mesh[mu=0.0]", "mesh[mu=0.1]"]
    assert len(sweep.runs()) == 6
    assert sweep.config(sweep.arms[2], 1).balance_mu == pytest.approx(0.1)


def test_print_commands_are_runnable_train_lines(grid, capsys):
    assert cli_main(["sweep", str(grid), "--print-commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6
    argv = shlex.split(lines[2])
    assert argv[:2] == ["meshrl", "train"] and "mesh.mu=0.0" in argv and "recipe=mesh" in argv
    assert cli_main(argv[1:]) == 0  # the printed line itself trains


def test_run_resume_and_parity(grid, tmp_path):
    summary = run_sweep(load_sweep(grid))
    assert summary["budget_parity"] is True
    assert all(r["seeds_done"] == 2 and r["rollouts_per_seed"] == [16.0, 16.0] for r in summary["arms"])
    before = (tmp_path / "runs" / "grpo" / "seed_0" / "metrics.jsonl").read_text()
    run_sweep(load_sweep(grid))  # everything finished: nothing reruns
    assert (tmp_path / "runs" / "grpo" / "seed_0" / "metrics.jsonl").read_text() == before
    assert json.loads((tmp_path / "runs" / "sweep_summary.json").read_text())["budget_parity"]


def test_parity_violation_is_reported(tmp_path, caplog):
    path = tmp_path / "g.yaml"
    path.write_text(GRID.format(out=tmp_path / "r").replace("grid: {mesh.mu: [0.0, 0.1]}",
                                                            "set: {mesh.budget: per_prefix}"))
    summary = run_sweep(load_sweep(path))
    assert summary["budget_parity"] is False
    assert "BUDGET PARITY VIOLATED" in caplog.text


def test_bad_arm_is_named(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("arms:\n  - name: x\n    recipe: nope\n")
    with pytest.raises(ValueError, match="arm 'x'.*unknown recipe"):
        load_sweep(path)
