"""MEI computed inside the training loop, its threshold warnings and resume of the warning state."""

from __future__ import annotations

import json

import pytest
import torch

from meshrl.diagnostics import bias_features, mei_metrics
from meshrl.jsonl import read_jsonl
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, train
from meshrl.trainer.batch import response_logits

BASE = [*TINY_RUN, "rollout.prompts_per_step=2", "rollout.group_size=8", "rollout.max_new_tokens=4",
        "train.micro_batch_size=5", "diag.mei.every=1", "optim.lr=1e-5", "checkpoint.every=10"]


def test_grpo_run_logs_mei_every_step(tmp_path):
    hist = train(load_config(overrides=[*BASE, "steps=2"]), tmp_path / "r")
    for m in hist:
        assert m["mei/feature"] == "bias"
        assert 0.0 <= m["mei/query"] <= 8.0
        assert m["mei/g_over_mei"] == pytest.approx(m["mei/bias/query_g_over_mei"])
        assert m["mei/directions"] == pytest.approx(m["mei/bias/query_directions"])
        assert 1.0 <= m["mei/directions"] <= 8.0  # a count of directions among G = 8 rollouts
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert all("mei/query" in r and "mei/directions" in r for r in rows)


def test_in_loop_mei_equals_an_independent_forward(tmp_path):
    # Micro-batches of 5 split query groups of 8: the monitor must still assemble each group exactly.
    tr = Trainer(load_config(overrides=[*BASE, "steps=1", "optim.lr=1e-12"]), tmp_path / "x")
    data, _ = tr.sampler.run(0, 0)
    tr.mei.begin(len(data))
    tr.update(data, collect_mei=True)
    got, _ = tr.mei.finish(data, 1)
    mb = tr.forward.collate(data.prompt_ids, data.response_ids)
    with torch.no_grad():
        phi = bias_features(response_logits(tr.model, mb), mb.response_ids, mb.response_mask)
    want = mei_metrics(phi, data.query_ids, None, feature="bias")
    assert got["mei/query"] == pytest.approx(want["mei/bias/query"], rel=1e-4)


def test_mesh_runs_report_both_scales(tmp_path):
    hist = train(load_config(overrides=[*BASE, "recipe=cp_only", "steps=1"]), tmp_path / "m")
    assert 0 <= hist[0]["mei/prefix_group"] <= 2.0  # groups of G/m = 2 rollouts
    assert 0 <= hist[0]["mei/query"] <= 8.0  # all 8 rollouts of the query


def test_threshold_crossing_warns_and_records_the_first_step(tmp_path):
    calib = tmp_path / "threshold.json"
    calib.write_text(json.dumps({"threshold": 0.0, "feature": "bias", "group_size": 8, "mean": 0, "std": 0}))
    train(load_config(overrides=[*BASE, "steps=3", f"diag.mei.threshold={calib}", "diag.mei.patience=2"]),
          tmp_path / "w")
    events = read_jsonl(tmp_path / "w" / "events.jsonl")
    kinds = [(e["event"], e["step"]) for e in events]
    assert ("mei_first_crossing", 1) in kinds and ("mei_warning", 2) in kinds
    assert sum(1 for k, _ in kinds if k == "mei_warning") == 1


def test_threshold_file_must_match_feature(tmp_path):
    calib = tmp_path / "t.json"
    calib.write_text(json.dumps({"threshold": 1.5, "feature": "head", "group_size": 8}))
    with pytest.raises(ValueError, match="calibrated with feature 'head'"):
        train(load_config(overrides=[*BASE, "steps=1", f"diag.mei.threshold={calib}"]), tmp_path / "f")
