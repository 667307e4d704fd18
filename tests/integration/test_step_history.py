"""``train()`` returns the steps' metrics without keeping them in memory: a read-only sequence backed by the run's
``metrics.jsonl`` whose size does not grow with the number of steps, and that reads like the list it replaces."""

from __future__ import annotations

import gc
import math
import tracemalloc

import pytest

from meshrl.jsonl import JsonlWriter, truncate_after_step
from meshrl.testing import TINY_RUN
from meshrl.trainer import load_config, train
from meshrl.trainer import loop as loop_module
from meshrl.trainer.history import StepHistory
from meshrl.trainer.step_data import StepData


def _metrics(step: int) -> dict:
    """About 4 KB of metrics, as a real step has (plug-ins and diagnostics add many keys)."""
    return {"step": step, "reward/mean": step / 7, "acc/mean": 0.5, "lr": 1e-3,
            **{f"diag/metric_{k:03d}": step * 1.000001 + k for k in range(60)}}


class _Health:
    stalled_in_row = 0

    def verdict(self, metrics, bad_in_row, run_dir, last_reward_failure=None):
        return None


class _FakeTrainer:
    """The loop's view of a trainer, with steps that cost nothing but return a real step's metrics."""

    def __init__(self, cfg, run_dir):
        self.cfg, self.run_dir, self.step_idx, self.bad_in_row = cfg, run_dir, 0, 0
        self.health, self.evaluator, self.task, self.dirty = _Health(), None, None, False
        self.last_data, self.pending_events = StepData(), []

    def step(self):
        self.step_idx += 1
        return _metrics(self.step_idx)

    def last_reward_failure(self):
        return None

    def end_step(self):
        pass

    def save(self):
        pass

    def close(self):
        pass


def test_train_keeps_constant_memory_over_2000_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(loop_module, "Trainer", _FakeTrainer)
    monkeypatch.setattr(loop_module, "config_record", lambda cfg, task: {})
    sizes = {}
    for steps in (200, 2000):
        cfg = load_config(overrides=[*TINY_RUN, f"steps={steps}", "checkpoint.every=100000"])
        gc.collect()
        tracemalloc.start()
        try:
            hist = train(cfg, tmp_path / f"run{steps}")
            gc.collect()
            sizes[steps] = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert len(hist) == steps and hist[-1] == _metrics(steps)
    # a list of every step's metrics held 1800 x ~4 KB more after 2000 steps than after 200
    assert sizes[2000] - sizes[200] < 200_000, sizes
    assert hist[0] == _metrics(1) and hist[1234] == _metrics(1235)
    assert hist[1998:] == [_metrics(1999), _metrics(2000)]
    assert list(hist) == [_metrics(s) for s in range(1, 2001)]


def _history(tmp_path, records: list[dict], first_step: int = 0) -> StepHistory:
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    hist = StepHistory(path, first_step)
    for m in records:
        writer.write(m)
        hist.append(m)
    writer.close()
    return hist


def test_the_history_reads_like_the_list_it_replaces(tmp_path):
    records = [{"step": s, "loss": s / 3, "n": s, "flag": s % 2 == 0, "name": "x"} for s in range(1, 6)]
    hist = _history(tmp_path, records)
    assert len(hist) == 5 and bool(hist) and hist == records and records == hist and hist == tuple(records)
    assert hist[0] == records[0] and hist[-2] == records[-2] and hist[-1] is records[-1]
    assert hist[1:4] == records[1:4] and hist[::-2] == records[::-2] and hist[10:] == []
    assert [m["step"] for m in hist] == [1, 2, 3, 4, 5] and records[2] in hist
    assert hist.index(records[3]) == 3 and hist != records[:4]
    with pytest.raises(IndexError):
        hist[5]
    with pytest.raises(IndexError):
        hist[-6]
    assert not StepHistory(tmp_path / "none.jsonl", 0) and list(StepHistory(tmp_path / "none.jsonl", 0)) == []


def test_a_resumed_run_returns_only_its_own_steps_and_non_finite_values_come_back_as_floats(tmp_path):
    path = tmp_path / "metrics.jsonl"
    JsonlWriter(path).write({"step": 1, "loss": 0.5})  # the first run's step
    hist = _history(tmp_path, [{"step": 2, "loss": math.inf}, {"step": 3, "loss": math.nan}], first_step=1)
    assert [m["step"] for m in hist] == [2, 3]
    assert hist[0]["loss"] == math.inf and math.isnan(hist[1]["loss"]) and math.isnan(list(hist)[1]["loss"])
    with pytest.raises(ValueError, match="step 5 after step 3"):
        hist.append({"step": 5})


def test_a_history_whose_file_was_rewound_says_so(tmp_path):
    hist = _history(tmp_path, [{"step": s} for s in range(1, 5)])
    truncate_after_step(tmp_path / "metrics.jsonl", 2)  # a later --resume from step 2 of the same directory
    assert hist[1] == {"step": 2}
    with pytest.raises(LookupError, match="metrics.jsonl: no record of step 3"):
        list(hist)
    (tmp_path / "metrics.jsonl").unlink()  # e.g. a temporary run directory, gone
    assert hist[-1] == {"step": 4}  # the last step's metrics stay in memory
    with pytest.raises(LookupError, match="metrics.jsonl: no such file"):
        hist[0]
