"""The demo's reading of a run, on hand-made curves: fell / back / kept, MEI's crossing, sparklines, rates."""

from __future__ import annotations

import json
import math

import pytest

from meshrl.testbed.demo_story import (
    fall_and_return,
    mei_crossing,
    mei_per_checkpoint,
    outcome,
    rates,
    run_story,
    sparkline,
    story_table,
)


def test_sparkline_maps_0_to_the_lowest_bar_and_top_to_the_highest():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([0.0, math.nan, 2.0], top=2.0) == "▁·█"
    assert sparkline([3.0, -1.0]) == "█▁"  # clipped


@pytest.mark.parametrize(("curve", "want"), [
    # GRPO seed 1 of the exploration: 0.29 at the first checkpoint, 0.00 at step 8, back at 24
    ([(0, 0.39), (4, 0.29), (8, 0.0), (12, 0.06), (16, 0.09), (20, 0.2), (24, 0.65), (28, 0.89)],
     {"fell": 8, "low": 0.0, "back": 24}),
    # a dip of less than 0.2 below the running maximum is no fall
    ([(0, 0.39), (4, 0.31), (8, 0.35), (12, 0.9)], {"fell": None, "low": None, "back": None}),
    # the running maximum counts later peaks; 0.9 -> 0.65 is 0.25 lower but the niche is still held (>= 0.5): the
    # fall is at 0.45, and it is back at the next checkpoint >= 0.5
    ([(0, 0.3), (4, 0.9), (8, 0.65), (12, 0.45), (16, 0.7)], {"fell": 12, "low": 0.45, "back": 16}),
    # forking tokens' seed 0 of the demo: 0.97 -> 0.59 -> 0.97 never lost the niche: no fall, no trivial return
    ([(0, 0.39), (24, 0.97), (28, 0.59), (32, 0.97)], {"fell": None, "low": None, "back": None}),
    # exactly 0.2 below counts (ends included); never back
    ([(0, 0.4), (4, 0.2), (8, 0.1)], {"fell": 4, "low": 0.1, "back": None}),
])
def test_fall_and_return(curve, want):
    assert fall_and_return(curve) == want


def test_outcome_uses_the_experiments_band():
    assert [outcome(v) for v in (0.61, 0.6, 0.4, 0.39)] == ["kept", "borderline", "borderline", "lost"]


def test_mei_crossing_needs_three_steps_in_a_row_above_3_sigma_of_the_first_four():
    calib = [(1, 1.0), (2, 2.0), (3, 1.0), (4, 2.0)]  # mean 1.5, sd 0.57735 -> line 3.232
    line, step = mei_crossing([*calib, (5, 9.0), (6, 9.0), (7, 1.0), (8, 4.0), (9, 4.0), (10, 4.0), (11, 9.0)])
    assert line == pytest.approx(1.5 + 3 * 0.5773502691896257)
    assert step == 8
    assert mei_crossing([*calib, (5, 9.0), (6, math.nan), (7, 9.0)]) == (pytest.approx(line), None)
    assert mei_crossing([(1, 1.0)]) == (None, None)


def _write(run, evals, mei):
    run.mkdir()
    (run / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "mei/query": v}) + "\n" for s, v in mei))


def test_run_story_reads_the_records_and_says_whether_mei_warned(tmp_path):
    evals = [{"step": s, "eval/mean@1": 0.5, "eval/by/decade/mean@1": v}
             for s, v in [(0, 0.4), (4, 0.4), (8, 0.4), (12, 0.1), (16, 0.8)]]
    mei = [(s, 1.0 + (s % 2)) for s in range(1, 5)] + [(s, 9.0) for s in range(5, 17)]
    _write(tmp_path / "r", evals, mei)
    story = run_story(tmp_path / "r")
    assert (story["fell"], story["back"], story["outcome"], story["mei_crossed"]) == (12, 16, "kept", 5)
    assert story["warned"] is True and story["accuracy_last"] == 0.5  # 7 steps ahead: a whole interval
    assert mei_per_checkpoint(story) == [1.5, 9.0, 9.0, 9.0]
    table = story_table({"grpo": {0: story}}, 4)
    assert "| grpo | 0 | `▄▄▄▂▇` | step 12 (to 0.10) | step 16 | 0.80 kept |" in table
    assert "step 5 (7 before the fall)" in table
    # a crossing less than one evaluation interval before the checkpoint that saw the fall is no warning: the
    # fall happened somewhere in that interval
    _write(tmp_path / "early", evals[:1] + [{**e, "step": e["step"] - 4} for e in evals[2:]], mei)
    story = run_story(tmp_path / "early")
    assert (story["fell"], story["mei_crossed"], story["warned"]) == (8, 5, False)


def test_run_story_refuses_records_without_the_niche_from_step_0(tmp_path):
    _write(tmp_path / "r", [{"step": 4, "eval/mean@1": 0.5}], [(1, 1.0)])
    with pytest.raises(ValueError, match=r"evals.jsonl.*eval/by/decade/mean@1.*eval.at_start"):
        run_story(tmp_path / "r")


def test_rates_count_per_arm():
    def story(fell, back, last, crossed):
        return {"fell": fell, "back": back, "outcome": outcome(last), "mei_crossed": crossed,
                "warned": fell is not None and crossed is not None and crossed < fell}

    stories = {"grpo": {0: story(8, 24, 0.9, 12), 1: story(None, None, 0.95, 10), 2: story(4, None, 0.1, 2)},
               "fork": {0: story(None, None, 0.5, None)}}
    r = rates(stories)
    assert r["grpo"] == {"seeds": [0, 1, 2], "runs": 3, "fell": 2, "back": 1, "steps_to_back": [16], "kept": 2,
                         "lost": 1, "borderline": 0, "warned": 1, "false_alarms": 1, "no_fall": 1}
    assert r["fork"]["borderline"] == 1 and r["fork"]["false_alarms"] == 0
