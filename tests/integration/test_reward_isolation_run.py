"""A training run survives a scorer that exits: each exit is a counted reward error."""

from __future__ import annotations

import os
import sys
import zlib

from meshrl.tasks import load_task
from meshrl.trainer import load_config, train

FAST = [
    "model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=4", "rollout.group_size=4",
    "rollout.max_new_tokens=6", "train.micro_batch_size=8", "log.progress=false", "checkpoint.every=1", "steps=2",
]


def test_a_scorer_calling_sys_exit_or_os_exit_costs_counted_errors_not_the_run(tmp_path, monkeypatch):
    task_class = type(load_task("tiny:repeat", seed=0))
    real_score = task_class.score

    def exiting_score(self, completion, problem):
        kind = zlib.crc32(completion.encode()) % 4  # deterministic: the same completions exit in every run
        if kind == 0:
            sys.exit(0)
        if kind == 1:
            os._exit(3)
        return real_score(self, completion, problem)

    monkeypatch.setattr(task_class, "score", exiting_score)
    hist = train(load_config(overrides=FAST), tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2]  # before: the process exited at the first sys.exit
    errors = sum(m["reward/errors"] for m in hist)
    assert 0 < errors <= 2 * 16 and all(m["reward/timeouts"] == 0 for m in hist)
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()
