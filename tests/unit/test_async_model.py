"""benchmarks/async_model.py: the overlap model of asynchronous rollouts, on hand-computed cases."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import async_model as am  # noqa: E402


def test_synchronous_and_the_best_split_by_hand():
    p = am.Phases(sample=30.0, update=60.0, sync=1.0, cores=4)
    assert am.synchronous(p) == 91.0
    # perfectly parallel phases: sample on c cores takes 30*4/c, update on 4-c takes 60*4/(4-c) + 1
    assert am.split_step(p, 1) == max(120.0, 81.0) and am.split_step(p, 2) == max(60.0, 121.0)
    assert am.best_split(p) == (1, 120.0)  # splitting perfectly parallel work loses: 120 s against 91 s
    serial = am.Phases(sample=30.0, update=60.0, sync=1.0, cores=4, sample_exponent=0.0, update_exponent=0.0)
    assert am.best_split(serial) == (1, 61.0)  # phases that do not use more cores overlap for free: 91 -> 61 s
    assert am.separate_devices(p) == 61.0 and am.separate_devices(p, transfer=5.0) == 65.0
    assert am.best_split(am.Phases(1.0, 2.0, cores=1)) == (1, 3.0)  # one core: nothing overlaps


def test_scaling_exponent_and_a_runs_phases(tmp_path):
    assert am.scaling_exponent(20.0, 1, 10.0, 2) == pytest.approx(1.0)
    assert am.scaling_exponent(10.0, 1, 10.0, 2) == 0.0 and am.scaling_exponent(14.14, 1, 10.0, 2) == pytest.approx(
        0.5, abs=1e-3)
    rows = [{"step": 1, "time/rollout_s": 99.0, "time/train_s": 99.0}] + [
        {"step": i, "time/rollout_s": 10.0 + i, "time/train_s": 20.0} for i in range(2, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = am.phases_of_run(tmp_path, cores=2)
    assert (p.sample, p.update) == (13.0, 20.0)  # medians, the first step left out
    assert am.main([str(tmp_path)]) == 0


def test_bad_input_is_one_line(capsys):
    with pytest.raises(ValueError, match="sample must be a finite number"):
        am.Phases(sample=float("nan"), update=1.0)
    with pytest.raises(ValueError, match="sample_cores must be in"):
        am.split_step(am.Phases(1.0, 1.0, cores=2), 2)
    assert am.main([]) == 2 and "give a run directory" in capsys.readouterr().err
