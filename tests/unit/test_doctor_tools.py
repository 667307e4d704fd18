"""The doctor's checks of tool-using runs and of a reward without correct answers, on constructed records at
their documented thresholds (docs/doctor.md)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_doctor import TH, ids, records  # noqa: E402

from meshrl.doctor import diagnose_records  # noqa: E402

N = 20


def _finding(rec, fid):
    return next(f for f in diagnose_records(rec).findings if f.id == fid)


def test_single_turn_runs_say_the_tool_checks_do_not_apply():
    diag = diagnose_records(records(reward__mean=0.5, acc__mean=0.5))
    reasons = {u.id: u.reason for u in diag.unchecked}
    assert reasons["tool_use_collapse"] == "no tools/* metrics: not a tool-using run"


def test_tool_use_collapse_at_half_the_first_window_and_alarm_when_held_out_fell():
    falling = [1.0] * 8 + [0.45] * 12  # last window 0.45 <= 0.5 x first 1.0
    shares = {"tools__share__calculator": 1.0}
    f = _finding(records(tools__calls_mean=falling, **shares), "tool_use_collapse")
    assert f.severity == "warning" and f.evidence["share_calculator"] == "1.00 -> 1.00"
    assert f.steps[0] == 9  # half-way (smoothed) between the windows
    evals = [{"step": 4.0, "eval/mean@1": 0.6}, {"step": 20.0, "eval/mean@1": 0.3}]
    assert _finding(records(tools__calls_mean=falling, evals=evals), "tool_use_collapse").severity == "alarm"
    assert "tool_use_collapse" not in ids(records(tools__calls_mean=[1.0] * 8 + [0.55] * 12))  # 0.55 > 0.5
    # A run that barely called a tool has no tool use to lose.
    assert "tool_use_collapse" not in ids(records(tools__calls_mean=[0.15] * 8 + [0.0] * 12))


def test_tool_errors_and_parse_failures_at_their_shares():
    f = _finding(records(tools__calls_mean=1.0, tools__error_frac=[0.0] * 10 + [0.25] * 10), "tool_errors")
    assert "up from 0%" in f.what and f.severity == "warning"
    assert "tool_errors" not in ids(records(tools__calls_mean=1.0, tools__error_frac=0.19))
    g = _finding(records(tools__calls_mean=1.0, tools__parse_fail_frac=0.3), "tool_parse_failures")
    assert "from the start" in g.what
    assert "tool_parse_failures" not in ids(records(tools__calls_mean=1.0, tools__parse_fail_frac=0.19))


def test_episodes_ended_by_a_limit():
    f = _finding(records(tools__calls_mean=2.0, turns__limit_frac=0.5, turns__mean=4.0), "turn_limit")
    assert f.evidence["turns_last_window"] == 4.0
    assert "turn_limit" not in ids(records(tools__calls_mean=2.0, turns__limit_frac=0.49))


def test_reward_without_accuracy():
    rising = [0.1 + 0.02 * i for i in range(N)]
    f = _finding(records(reward__mean=rising, acc__mean=0.0), "reward_without_accuracy")
    assert f.severity == "warning" and f.evidence["acc_max"] == 0.0
    assert "reward_without_accuracy" not in ids(records(reward__mean=rising, acc__mean=[0.0] * 19 + [0.03]))
    assert "reward_without_accuracy" not in ids(records(reward__mean=[0.1] * N, acc__mean=0.0))  # no rise
    assert TH.format_only_acc == 0.02
