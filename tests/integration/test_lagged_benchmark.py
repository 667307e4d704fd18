"""benchmarks/lagged_step_rate.py runs end to end (its CPU dry run) and reports every arm, the phase split and the
cost model's prediction beside the CPU it ran on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from lagged_step_rate import main, summarise  # noqa: E402


def test_the_dry_run_reports_each_arm_and_the_model(tmp_path):
    out = tmp_path / "lag.json"
    assert main(["--dry-run", "--ks", "0,1", "--every-row", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["arms"]) - {"0@1"} == {"0", "1", "1_every_row"}
    for arm in res["arms"].values():
        assert arm["steps_per_s"] > 0 and arm["sample_s"] > 0 and arm["train_s"] > 0 and arm["wait_s"] >= 0
    assert res["cpu"]["flags"] is not None and len(res["load_before"]) == 3
    if res["torch_threads"] >= 2:
        assert res["model"]["predicted_lagged_step_s"] > 0
        assert "gain_vs_k0" in res["arms"]["1"] and "gain_vs_k0" in res["arms"]["1_every_row"]


def test_summary_leaves_out_the_warm_up_steps():
    rows = [{"time/step_s": 10.0, "time/rollout_s": 9.0, "time/train_s": 1.0}] + [
        {"time/step_s": 2.0, "time/rollout_s": 1.5, "time/train_s": 0.5}] * 3
    s = summarise(rows, warmup=1)
    assert s["steps_per_s"] == 0.5 and s["sample_s"] == 1.5 and s["wait_s"] == 1.5 and s["train_s"] == 0.5
