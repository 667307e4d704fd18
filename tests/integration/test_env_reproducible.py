"""Tool-using (``env:``) runs are bit-reproducible: two runs with one seed, and a run killed mid-episode then
resumed, give the same metrics and weights. The default step shape (8 prompts x 8 episodes, 64 tokens a turn) is
the one that showed the divergence: the episodes' long prompts (the tool schemas) make the update's shared-prompt
pass large enough to run multi-threaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

import meshrl.agents.episode as episode_mod
from meshrl.jsonl import read_jsonl
from meshrl.trainer import load_config, train

ENV_RUN = ["model=tiny", "task=env:calculator?data=tiny:repeat", "log.progress=false", "checkpoint.every=1"]
STEPS = 2
TIME_KEYS = ("time/", "throughput/")


def _cfg(steps: int = STEPS):
    return load_config(overrides=[*ENV_RUN, f"steps={steps}"])


def _records(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in read_jsonl(run / "metrics.jsonl")]


def _assert_same(run: Path, other: Path) -> None:
    assert _records(run) == _records(other)
    ours = load_file(str(run / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))
    theirs = load_file(str(other / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not (ours[k] == theirs[k]).all()] == []


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("env_full") / "run"
    train(_cfg(), run)
    return run


def test_two_env_runs_with_one_seed_are_bitwise_equal(tmp_path, full_run):
    train(_cfg(), tmp_path / "run")
    _assert_same(tmp_path / "run", full_run)


def test_an_env_run_killed_mid_episode_resumes_exactly(tmp_path, monkeypatch, full_run):
    real, calls = episode_mod._advance, []

    def advance_then_kill(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # step 2's first turn is sampled; its episodes are half done
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(episode_mod, "_advance", advance_then_kill)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints" / f"step_{STEPS:06d}").exists()
    monkeypatch.undo()
    train(_cfg(), tmp_path / "run", resume=True)
    _assert_same(tmp_path / "run", full_run)
