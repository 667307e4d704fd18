"""A finished trainer is collected with everything it held: its model (weights in shared memory, one open
descriptor per tensor), its pipes and its worker processes. The collector is frozen while worker pools are open
(forkpool.freeze_objects_before_fork) and must thaw when the last one closes, or every trainer of a process (a
sweep, a test session) stays alive: 24 descriptors per tiny trainer, until select() failed past 1024."""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from meshrl.forkpool import fork_available
from meshrl.trainer import Trainer, load_config, train

pytestmark = pytest.mark.skipif(not fork_available() or not os.path.isdir("/proc/self/fd"),
                                reason="needs forked workers and /proc")

FAST = ["model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=6", "train.micro_batch_size=8", "log.progress=false", "steps=2",
        "rollout.decode_workers=2", "train.update_workers=2"]


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_trainers_leave_nothing_behind(tmp_path):
    train(load_config(overrides=FAST), tmp_path / "warm")  # imports, caches and the like settle first
    gc.collect()
    before = _open_descriptors()
    for k in range(3):
        train(load_config(overrides=FAST), tmp_path / f"run{k}")
    trainer = Trainer(load_config(overrides=FAST), tmp_path / "kept")
    trainer.step()
    model = weakref.ref(trainer.model)
    trainer.close()
    del trainer
    gc.collect()
    assert model() is None  # the trainer and its model were collected
    assert gc.get_freeze_count() == 0  # no pool open: nothing left frozen
    assert _open_descriptors() <= before
