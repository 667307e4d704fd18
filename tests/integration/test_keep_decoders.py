"""rollout.keep_decoders=false: the native decoder's worker processes end after each rollout (the update runs without
them) and are forked again for the next; the samples and the training are the same as with them kept."""

from __future__ import annotations

import pytest
import torch

from meshrl.forkpool import fork_available
from meshrl.trainer import Trainer, load_config

pytestmark = pytest.mark.skipif(not fork_available(), reason="needs forked worker processes")


def _run(tmp_path, keep: bool):
    cfg = load_config(overrides=["model=tiny", "task=tiny:add", "steps=3", "rollout.prompts_per_step=4",
                                 "rollout.group_size=8", "rollout.max_new_tokens=6", "log.progress=false",
                                 "rollout.backend=native", "rollout.decode_workers=2",
                                 f"rollout.keep_decoders={str(keep).lower()}"])
    trainer = Trainer(cfg, tmp_path / f"keep_{keep}")
    pools_during_update = []
    real_update = trainer.update

    def update(*a, **k):
        pool = trainer.backend._pool
        pools_during_update.append(None if pool is None else [p.pid for p in pool.procs])
        return real_update(*a, **k)

    trainer.update = update
    metrics = [trainer.step() for _ in range(3)]
    samples = trainer.last_data.response_ids
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.close()
    return metrics, samples, weights, pools_during_update


def test_the_workers_end_after_each_rollout_and_nothing_else_changes(tmp_path, monkeypatch):
    import meshrl.rollout.native as native

    started = []
    real_pool = native.ForkPool
    monkeypatch.setattr(native, "ForkPool", lambda *a, **k: (started.append(1), real_pool(*a, **k))[1])
    kept = _run(tmp_path, True)
    assert len(started) == 1
    released = _run(tmp_path, False)
    assert len(started) == 1 + 3  # forked again for every rollout
    assert all(p is not None for p in kept[3]) and len({tuple(p) for p in kept[3]}) == 1  # one pool, kept
    assert released[3] == [None, None, None]  # the update ran without worker processes
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))}  # noqa: E731
    assert [strip(m) for m in kept[0]] == [strip(m) for m in released[0]]
    assert kept[1] == released[1]
    assert all(torch.equal(a, b) for a, b in zip(kept[2], released[2], strict=True))
