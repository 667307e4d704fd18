"""Rollouts with bounded staleness (``rollout.max_staleness``, meshrl.trainer.lagged_rollouts): the fixed lag, the
two producers agreeing bit for bit, exact resumes (also after SIGTERM / SIGKILL), a sampler that dies, hangs or
fails, the correction's plug-ins and metrics, the settings refused by key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import meshrl
from meshrl.jsonl import read_jsonl
from meshrl.trainer.config import load_config
from meshrl.trainer.lagged_rollouts import (
    SamplerFailed,
    batch_from_json,
    batch_to_json,
    sampler_threads,
    staleness_metrics,
)
from meshrl.trainer.loop import train
from meshrl.trainer.rollout_step import RolloutStep
from meshrl.trainer.step import sampler_behaviour
from meshrl.trainer.step_data import Sample, StepData

BASE = ["model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=6", "optim.lr=1e-2", "eval.every=0", "log.samples_per_step=2"]
TIME_KEYS = ("time/", "throughput/")


def _cfg(*extra: str, steps: int = 5):
    return load_config(None, [*BASE, f"steps={steps}", *extra])


def _records(run: Path) -> dict[str, list[dict]]:
    return {name: [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in read_jsonl(run / name)]
            for name in ("metrics.jsonl", "samples.jsonl")}


@pytest.fixture(scope="module")
def lag2_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("lag") / "process"
    train(_cfg("rollout.max_staleness=2", "rollout.sampler_process=process", "checkpoint.every=2", steps=6), run)
    return run


def test_each_batch_comes_from_the_weights_k_steps_back(lag2_process):
    rows = read_jsonl(lag2_process / "metrics.jsonl")
    assert [r["lag/policy_version"] for r in rows] == [0, 0, 0, 1, 2, 3]  # max(0, s - 2), s = 0 ..
    assert [r["lag/staleness_max"] for r in rows] == [0, 1, 2, 2, 2, 2]
    assert all(r[f"lag/staleness/{int(r['lag/staleness_mean'])}"] == 1.0 for r in rows)
    assert all("rollout_corr/weight_mean" in r for r in rows)  # TIS on by default
    assert all(0 < r["rollout_corr/ess"] <= 1 and r["rollout_corr/weight_max"] > 0 for r in rows)
    samples = read_jsonl(lag2_process / "samples.jsonl")
    assert {(s["step"], s["policy_version"]) for s in samples} == {(1, 0), (2, 0), (3, 0), (4, 1), (5, 2), (6, 3)}
    config = yaml.safe_load((lag2_process / "config.yaml").read_text())
    assert config["plugins"]["rollout_corr"]["enabled"] is True  # the record says what ran
    assert any(r["grad/norm"] > 0 for r in rows[:3])  # the weights moved, so the later batches are really stale:
    assert all(r["rollout_corr/weight_mean"] != 1.0 for r in rows[4:])  # the lag is measured and weighted


def test_the_inline_producer_gives_the_same_run(lag2_process, tmp_path):
    run = tmp_path / "inline"
    train(_cfg("rollout.max_staleness=2", "rollout.sampler_process=inline", "checkpoint.every=2", steps=6), run)
    assert _records(run) == _records(lag2_process)


def test_a_resume_continues_the_lagged_run_exactly(lag2_process, tmp_path):
    run = tmp_path / "resumed"
    cfg = _cfg("rollout.max_staleness=2", "rollout.sampler_process=process", "checkpoint.every=2", steps=3)
    train(cfg, run)  # a checkpoint at step 3: batches 4 and 5 were sampled ahead, from versions 1 and 2
    cfg.steps = 6
    train(cfg, run, resume=True)
    assert _records(run) == _records(lag2_process)


def test_k0_is_the_plain_loop(tmp_path):
    run = tmp_path / "k0"
    train(_cfg(steps=2), run)
    rows = read_jsonl(run / "metrics.jsonl")
    assert not any(k.startswith(("lag/", "rollout_corr/")) for r in rows for k in r)


def _in_child(parent: int) -> bool:
    return os.getpid() != parent


def test_a_sampler_that_dies_is_started_again(lag2_process, tmp_path, monkeypatch, caplog):
    parent, marker, real = os.getpid(), tmp_path / "died", RolloutStep.run

    def dying(self, step, cursor):
        if step == 3 and _in_child(parent) and not marker.exists():
            marker.touch()
            os._exit(3)
        return real(self, step, cursor)

    monkeypatch.setattr(RolloutStep, "run", dying)
    run = tmp_path / "run"
    train(_cfg("rollout.max_staleness=2", "rollout.sampler_process=process", "checkpoint.every=2", steps=6), run)
    assert marker.exists()
    assert any("sampler process ended" in r.getMessage() for r in caplog.records)
    assert _records(run) == _records(lag2_process)  # regenerated from the ring: the same batches


def test_a_silent_sampler_ends_the_run_with_one_line(tmp_path, monkeypatch):
    parent, real = os.getpid(), RolloutStep.run

    def hanging(self, step, cursor):
        if step == 2 and _in_child(parent):
            time.sleep(3600)
        return real(self, step, cursor)

    monkeypatch.setattr(RolloutStep, "run", hanging)
    with pytest.raises(SamplerFailed, match=r"sent nothing for \d+ s \(batch of step 3"):
        train(_cfg("rollout.max_staleness=1", "rollout.sampler_process=process", "rollout.sampler_timeout_s=2",
                   steps=4), tmp_path / "run")


def test_a_failure_in_the_sampler_is_raised_by_the_trainer(tmp_path, monkeypatch):
    parent, real = os.getpid(), RolloutStep.run

    def failing(self, step, cursor):
        if step == 1 and _in_child(parent):
            raise ValueError("grader exploded on step 2")
        return real(self, step, cursor)

    monkeypatch.setattr(RolloutStep, "run", failing)
    with pytest.raises(ValueError, match="grader exploded on step 2"):
        train(_cfg("rollout.max_staleness=1", "rollout.sampler_process=process", steps=3), tmp_path / "run")


def test_m2po_takes_the_ratio_against_the_sampler(tmp_path):
    run = tmp_path / "m2po"
    train(_cfg("rollout.max_staleness=1", "rollout.staleness_correction=m2po", "rollout.sampler_process=inline",
               steps=3), run)
    rows = read_jsonl(run / "metrics.jsonl")
    assert all(any(k.startswith("m2po/") for k in r) for r in rows)
    assert not any(k.startswith("rollout_corr/") for r in rows for k in r)


def test_no_correction_runs_without_weights(tmp_path):
    run = tmp_path / "none"
    train(_cfg("rollout.max_staleness=1", "rollout.staleness_correction=none", "rollout.sampler_process=inline",
               steps=2), run)
    assert not any(k.startswith(("rollout_corr/", "m2po/")) for r in read_jsonl(run / "metrics.jsonl") for k in r)


@pytest.mark.parametrize("setting,message", [
    ("plugins.replay.reuse_steps=2", "plugins.replay cannot run with rollout.max_staleness=1: its sampling hooks"),
    ("plugins.prompt_filter.enabled=true", "plugins.prompt_filter.enabled cannot run"),
])
def test_plugins_that_sample_are_refused_by_key(setting, message):
    with pytest.raises(ValueError, match=message):
        _cfg("rollout.max_staleness=1", setting)


def test_estr_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="plugins.estr.enabled cannot run .* entropy"):
        _cfg("rollout.max_staleness=1", "plugins.estr.enabled=true", "plugins.estr.tau=1.0")


def test_the_setting_bounds_are_checked():
    with pytest.raises(ValueError, match="rollout.max_staleness"):
        _cfg("rollout.max_staleness=-1")
    with pytest.raises(ValueError, match="rollout.staleness_correction"):
        _cfg("rollout.max_staleness=1", "rollout.staleness_correction=estr")


def test_sampler_threads_leave_the_update_at_least_one():
    cfg = _cfg()
    assert [sampler_threads(cfg, n) for n in (1, 2, 3, 16)] == [1, 1, 1, 8]
    cfg.rollout.sampler_threads = 12
    assert sampler_threads(cfg, 16) == 12 and sampler_threads(cfg, 4) == 3


def _batch() -> StepData:
    class P:
        def __init__(self, i):
            self.id, self.meta = f"p{i}", {}

    data = StepData()
    for i in range(3):
        data.append(Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5][: i + 1], text=f"t{i}", truncated=False,
                           problem=P(i % 2), group_id=i % 2, query_id=i % 2, strategy_id=-1, score=0.5 * i,
                           rollout_logps=[-0.1 * (j + 1) for j in range(i + 1)],
                           rollout_features=np.arange(4, dtype=np.float32) / 3 if i != 1 else None))
    data.rewards = torch.tensor([0.1, 1 / 3, 0.7], dtype=torch.float64)
    data.advantages = torch.tensor([-1 / 7, 0.0, 1 / 7])
    data.seen = [(t, s, p) for t, s, p in zip(data.texts, data.scores, data.problems, strict=True)]
    data.policy_versions = [4, 4, 4]
    return data


def test_a_batch_crosses_the_wire_exactly():
    data = _batch()
    back = batch_from_json(batch_to_json(data), {p.id: p for p in data.problems})
    assert back.rewards.dtype == torch.float64 and torch.equal(back.rewards, data.rewards)
    assert torch.equal(back.advantages, data.advantages)
    assert back.rollout_logps == data.rollout_logps and back.policy_versions == [4, 4, 4]
    assert back.rollout_features[1] is None and np.array_equal(back.rollout_features[0], data.rollout_features[0])
    assert [p.id for p in back.problems] == [p.id for p in data.problems]


def test_staleness_metrics_are_a_histogram():
    data = _batch()
    data.policy_versions = [3, 4, 4]
    out = staleness_metrics(data, 5)
    assert out["lag/staleness/2"] == pytest.approx(1 / 3) and out["lag/staleness/1"] == pytest.approx(2 / 3)
    assert out["lag/staleness_max"] == 2 and out["lag/policy_version"] == pytest.approx(11 / 3)
    assert staleness_metrics(StepData(), 5) == {}


def test_m2po_behaviour_is_the_sampler_where_it_sampled():
    data = _batch()
    data.unsampled = [0, 2, 0]  # row 1: a forced opening, not the sampler's
    start = [torch.full((len(r),), -9.0) for r in data.response_ids]
    out = sampler_behaviour(data, start)
    assert out[0].tolist() == pytest.approx([-0.1]) and out[2].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert out[1].tolist() == [-9.0, -9.0]
    data.rollout_logps[2] = None  # a sampled row without the sampler's log-probs: M2PO's ratio would be 1 there
    with pytest.raises(ValueError, match="m2po: row 2 has no sampler log-probs"):
        sampler_behaviour(data, start)


def test_a_correction_the_recipe_refuses_is_refused_by_its_setting():
    with pytest.raises(ValueError, match="rollout.staleness_correction=tis turns on its plug-in.*token-level"):
        _cfg("rollout.max_staleness=1", "recipe=grpo", "algo.policy_loss=gspo")
    _cfg("rollout.max_staleness=1", "recipe=grpo", "algo.policy_loss=gspo", "rollout.staleness_correction=none")


def test_mismatch_is_measured_on_rows_the_current_weights_sampled_only(lag2_process):
    rows = read_jsonl(lag2_process / "metrics.jsonl")
    assert any(k.startswith("mismatch/") for k in rows[0])  # step 1: sampled by the weights it trains
    assert not any(k.startswith("mismatch/") for r in rows[1:] for k in r)  # the lag is rollout_corr/*'s


def test_a_failed_sampler_is_not_started_again_for_the_stopping_checkpoint(tmp_path, monkeypatch):
    from meshrl.trainer.lagged_rollouts import ProcessProducer

    parent, real, starts = os.getpid(), RolloutStep.run, []
    real_start = ProcessProducer.start

    def failing(self, step, cursor):
        if step == 1 and _in_child(parent):
            raise ValueError("grader exploded on step 2")
        return real(self, step, cursor)

    def counted(self, *args, **kwargs):
        starts.append(args[0])
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(RolloutStep, "run", failing)
    monkeypatch.setattr(ProcessProducer, "start", counted)
    with pytest.raises(ValueError, match="grader exploded"):
        train(_cfg("rollout.max_staleness=1", "rollout.sampler_process=process", steps=3), tmp_path / "run")
    assert starts == [0]  # the stop's checkpoint did not fork a second sampler to wait on


def test_the_producers_agree_with_several_decode_workers(tmp_path):
    """More rows than one decode shard and two sampler threads: the native decoder shards rows over its workers,
    and the shards' shapes round the logits, so both producers must decode with the same count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        extra = ["rollout.max_staleness=1", "rollout.backend=native", "rollout.sampler_threads=2",
                 "rollout.prompts_per_step=4", "rollout.group_size=8"]
        train(_cfg(*extra, "rollout.sampler_process=process", steps=3), tmp_path / "process")
        train(_cfg(*extra, "rollout.sampler_process=inline", steps=3), tmp_path / "inline")
    finally:
        torch.set_num_threads(saved)
    assert _records(tmp_path / "process") == _records(tmp_path / "inline")


# ---------------------------------------------------------------------- kills at a step, then --resume
STEPS = 6
TRAIN = ["train", "--model", "tiny", "--task", "tiny:repeat", "--no-progress", "--steps", str(STEPS),
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "rollout.max_new_tokens=6",
         "--set", "optim.lr=1e-2", "--set", "checkpoint.every=2", "--set", "log.samples_per_step=2",
         "--set", "rollout.max_staleness=2", "--set", "rollout.sampler_process=process"]


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, "-c", "import sys; from meshrl.cli import main; sys.exit(main())", *args]


def _env() -> dict[str, str]:
    src = str(Path(meshrl.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_lagged_run_resumes_into_the_same_run(tmp_path, sig):
    ref = tmp_path / "ref"
    done = subprocess.run(_cli([*TRAIN, "--out", str(ref)]), env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    run = tmp_path / "killed"
    proc = subprocess.Popen(_cli([*TRAIN, "--out", str(run)]), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = run / "metrics.jsonl"
    while proc.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.01)
    if proc.poll() is None:
        os.killpg(proc.pid, sig)  # the trainer and its sampler process
    proc.communicate(timeout=600)
    if proc.returncode != 0:
        again = subprocess.run(_cli(["train", "--resume", str(run)]), env=_env(), capture_output=True, text=True,
                               timeout=600)
        assert again.returncode == 0, again.stderr[-2000:]
    assert _records(run) == _records(ref)


def test_mei_reads_the_sampler_features_of_lagged_batches(tmp_path, caplog):
    """MEI from the sampler's features of each batch (the behaviour policy's), every step, with live health on."""
    import logging

    run = tmp_path / "mei"
    with caplog.at_level(logging.INFO, logger="meshrl"):
        train(_cfg("rollout.max_staleness=1", "rollout.sampler_process=process", "diag.mei.every=1",
                   "health.every=2", "rollout.backend=native", steps=4), run)
    rows = read_jsonl(run / "metrics.jsonl")
    assert all("mei/query" in r for r in rows)
    said = [r.getMessage() for r in caplog.records]
    assert any("MEI features from the rollout" in m for m in said)
    assert not any("MEI features from the update's forward" in m for m in said)


def test_the_sampler_stops_when_told_although_later_forks_hold_its_pipe(tmp_path):
    """An evaluation's decode workers, forked from the trainer after the sampler, inherit the trainer's end of its
    pipe: the sampler must end on the trainer's word, not wait for an EOF that never comes (5 s, then killed)."""
    from meshrl.trainer.step import Trainer

    cfg = _cfg("rollout.max_staleness=1", "rollout.sampler_process=process", "rollout.backend=native",
               "rollout.decode_workers=2", "eval.every=1", steps=2)
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        for _ in range(2):
            trainer.step()
            trainer.evaluator(trainer.step_idx)  # forks the decode workers in the trainer's process
            trainer.end_step()
        proc = trainer.lag.producer.proc
        assert proc is not None and proc.is_alive()
    finally:
        t0 = time.monotonic()
        trainer.close()
        took = time.monotonic() - t0
    assert took < 4 and proc.exitcode == 0  # ended on its own, not killed after the 5 s join


def test_a_resume_with_another_lag_is_refused_and_hands_the_cores_back(lag2_process, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lag2_process, run)
    threads = torch.get_num_threads()
    with pytest.raises(ValueError, match="written with rollout.max_staleness=2, this run has 1"):
        train(_cfg("rollout.max_staleness=1", "rollout.sampler_process=process", steps=8), run, resume=True)
    assert torch.get_num_threads() == threads  # the update's share of the cores was given back
