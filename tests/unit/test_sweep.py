"""meshrl sweep: grid expansion and a bad arm named (runs, command lines, budget parity:
tests/integration/test_sweep_runs.py)."""

from __future__ import annotations

import pytest

from meshrl.trainer.sweep import load_sweep


def test_grid_expands_arms(sweep_grid):
    sweep = load_sweep(sweep_grid)
    assert [a.name for a in sweep.arms] == ["grpo", "mesh[mu=0.0]", "mesh[mu=0.1]"]
    assert len(sweep.runs()) == 6
    assert sweep.config(sweep.arms[2], 1).balance_mu == pytest.approx(0.1)


def test_bad_arm_is_named(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("arms:\n  - name: x\n    recipe: nope\n")
    with pytest.raises(ValueError, match="arm 'x'.*unknown recipe"):
        load_sweep(path)
