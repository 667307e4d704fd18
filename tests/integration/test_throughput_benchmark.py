"""benchmarks/throughput_vs_trl.py: both trainers see the same problems at every step (TRL reads meshrl's draw
order unshuffled), so their response lengths, step times and memory compare like for like."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("trl")
from throughput_vs_trl import TASK, distinct_in_order, meshrl_problem_order, run_pair  # noqa: E402

from meshrl.tasks import load_task  # noqa: E402
from meshrl.trainer import Trainer, load_config  # noqa: E402


def test_the_order_is_what_meshrls_trainer_draws(tmp_path):
    cfg = load_config(overrides=["model=tiny", f"task={TASK}", "seed=0", "steps=3", "rollout.prompts_per_step=3",
                                 "rollout.group_size=2", "rollout.max_new_tokens=4", "log.progress=false"])
    trainer = Trainer(cfg, tmp_path / "run")
    drawn = []
    for _ in range(3):
        trainer.step()
        drawn += distinct_in_order(q.id for q in trainer.last_data.problems)
    trainer.close()
    assert [q.id for q in meshrl_problem_order(load_task(TASK, seed=0), 9)] == drawn


def _args(same: bool) -> argparse.Namespace:
    return argparse.Namespace(micro_batch=None, lr=1e-5, bf16=False, warmup=1, steps=2, schedule="interleaved",
                              trl_defaults=False, same_problems=same)


@pytest.mark.slow
def test_the_pair_runs_on_the_same_problems():
    r = run_pair("tiny", 3, 2, 4, _args(True))
    assert r["same_problems"] is True  # run_pair raises when any step's problems differ
    assert r["meshrl"]["steps"] == r["trl"]["steps"] == 2


@pytest.mark.slow
def test_trls_own_shuffle_draws_other_problems(monkeypatch):
    import throughput_vs_trl

    seen = {}
    real = throughput_vs_trl.Side

    def keep(name):
        seen[name] = real(name)
        return seen[name]

    monkeypatch.setattr(throughput_vs_trl, "Side", keep)
    run_pair("tiny", 3, 2, 4, _args(False))
    # the check the default mode makes would have failed here: the two orders differ
    assert seen["meshrl"].problems != seen["trl"].problems
    assert all(len(step) == 3 for step in seen["trl"].problems)
