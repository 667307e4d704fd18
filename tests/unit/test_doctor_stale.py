"""The doctor's ``stale_rollouts`` check of lagged rollouts (``rollout.max_staleness = k``, the ``lag/*`` metrics),
on constructed records at its documented thresholds (docs/doctor.md): not applicable without a lag, silent on a
correction that holds, a warning when the truncated weights degenerate on more than a blip of the stale steps, and
one when the lag is trained on uncorrected."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_doctor import TH, records  # noqa: E402

from meshrl.cli import main as cli_main  # noqa: E402
from meshrl.doctor import diagnose, diagnose_records  # noqa: E402
from meshrl.doctor.live import FINDING_IDS  # noqa: E402

N, K = 20, 2


def lagged(n: int = N, k: int = K, **series) -> dict:
    """The ``lag/*`` metrics of a run with lag ``k``: step s trains on a batch sampled by version max(0, s - k), so
    the first steps are less stale (step 1 not at all)."""
    age = [min(s - 1, k) for s in range(1, n + 1)]
    return {"lag__policy_version": [s - 1 - a for s, a in zip(range(1, n + 1), age, strict=True)],
            "lag__staleness_mean": age, "lag__staleness_max": age,
            **{f"lag__staleness__{d}": [1.0 if a == d else None for a in age] for d in range(k + 1)}, **series}


def tis(ess, truncated, n: int = N) -> dict:
    """The ``rollout_corr/*`` metrics of ``staleness_correction=tis``: ``ess`` and ``truncated`` are constants or
    lists of ``n`` values."""
    return {"rollout_corr__weight_mean": 1.0, "rollout_corr__frac_rejected": 0.0, "rollout_corr__ess": ess,
            "rollout_corr__frac_truncated": truncated, "rollout_corr__weight_max": 1.5}


def stale(rec) -> list:
    return [f for f in diagnose_records(rec).findings if f.id == "stale_rollouts"]


def write_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(f"steps: {len(rows)}\nrollout:\n  max_staleness: {K}\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_check_is_registered_and_can_be_acted_on_live():
    assert "stale_rollouts" in FINDING_IDS


def test_a_run_without_a_lag_is_not_applicable(tmp_path):
    # k = 0 (or a run from before lagged rollouts): no lag/* metrics, even with the mismatch correction on.
    run = write_run(tmp_path / "k0", [{"step": s, "reward/mean": 0.5, "rollout_corr/ess": 0.2,
                                       "rollout_corr/frac_truncated": 0.5} for s in range(1, N + 1)])
    diag = diagnose(run)
    reasons = {u.id: u.reason for u in diag.unchecked}
    assert reasons["stale_rollouts"].startswith("no lag/* metrics: rollouts are not lagged")
    assert "stale_rollouts" not in diag.ids() and "stale_rollouts" not in diag.passed


def test_a_healthy_lagged_run_passes(tmp_path):
    rows = [{"step": s, "reward/mean": 0.5, "lag/staleness_max": min(s - 1, K), "lag/staleness_mean": min(s - 1, K),
             f"lag/staleness/{min(s - 1, K)}": 1.0, "lag/policy_version": s - 1 - min(s - 1, K),
             "rollout_corr/weight_mean": 1.0, "rollout_corr/ess": 0.95, "rollout_corr/frac_truncated": 0.01,
             "rollout_corr/weight_max": 1.3, "rollout_corr/frac_rejected": 0.0} for s in range(1, N + 1)]
    diag = diagnose(write_run(tmp_path / "ok", rows))  # through the run directory reader
    assert "stale_rollouts" in diag.passed and "stale_rollouts" not in diag.ids()
    assert "stale_rollouts" not in {u.id for u in diag.unchecked}


def test_a_correction_that_fails_on_many_stale_steps_warns_naming_the_worst(tmp_path, capsys):
    ess = [0.95, 0.9] + [0.3] * 12 + [0.95] * 6
    ess[7] = 0.21  # the worst step: 8
    rows = [{"step": s, "lag/staleness_max": min(s - 1, K), "lag/staleness_mean": min(s - 1, K),
             f"lag/staleness/{min(s - 1, K)}": 1.0, "rollout_corr/ess": ess[s - 1],
             "rollout_corr/frac_truncated": 0.05, "rollout_corr/weight_max": 7.5} for s in range(1, N + 1)]
    run = write_run(tmp_path / "bad", rows)
    found = [f for f in diagnose(run).findings if f.id == "stale_rollouts"]
    assert len(found) == 1
    f = found[0]
    assert f.severity == "warning" and f.steps == list(range(3, 13)) and f.confidence == "high"  # 0.5 / 0.21 > 2x
    assert "k = 2" in f.what and "rollout_corr/ess" in f.what and "0.21 at step 8" in f.what
    assert "12 of 19 stale step(s)" in f.what
    assert f.evidence["staleness_max"] == 2 and f.evidence["stale_steps"] == 19
    assert f.evidence["rollout_corr/ess"]["worst"][0] == {"step": 8, "value": 0.21}
    assert f.evidence["rollout_corr/ess"]["steps_below"] == 12
    assert f.evidence["weight_max_on_those_steps"] == 7.5
    assert f.evidence["row_share_by_staleness"] == {"0": 0.05, "1": 0.05, "2": 0.9}
    for knob in ("rollout.max_staleness", "optim.lr", "rollout.staleness_correction=m2po",
                 "plugins.rollout_corr.threshold only knowingly"):
        assert knob in f.knob
    # The CLI: a warning fails --fail-on warning; --set moves the threshold under the worst step's ESS.
    assert cli_main(["doctor", str(run), "--fail-on", "warning"]) == 3
    assert "(stale_rollouts)" in capsys.readouterr().out
    assert cli_main(["doctor", str(run), "--fail-on", "warning", "--set", "stale_ess_min=0.2"]) == 0


def test_the_truncated_share_alone_warns_and_older_runs_without_ess_are_judged_on_it():
    truncated = [0.0] * 10 + [0.35] * 10
    f, = stale(records(**lagged(**tis(None, truncated))))
    assert f.steps == list(range(11, 21)) and "rollout_corr/frac_truncated" in f.what and "0.35" in f.what
    assert f.evidence["not_logged"] == ["rollout_corr/ess"] and "rollout_corr/ess" not in f.evidence
    assert stale(records(**lagged(**tis(None, [0.0] * 10 + [0.2] * 10)))) == []  # at the limit: not above it


def test_the_thresholds_at_their_boundaries_and_overridden():
    assert stale(records(**lagged(**tis(0.5, 0.0)))) == []  # ESS at the limit is not below it
    assert len(stale(records(**lagged(**tis(0.49, 0.0))))) == 1
    rec = records(**lagged(**tis(0.45, 0.0)))
    assert diagnose_records(rec, TH.with_overrides({"stale_ess_min": "0.4"})).ids().count("stale_rollouts") == 0
    rec = records(**lagged(**tis(0.95, 0.15)))
    assert stale(rec) == []
    assert "stale_rollouts" in diagnose_records(rec, TH.with_overrides({"stale_truncated_max": 0.1})).ids()
    with pytest.raises(ValueError, match="stale_step_share"):
        TH.with_overrides({"stale_step_share": float("nan")})


def test_a_single_step_blip_does_not_warn():
    ess = [0.95] * N
    ess[9] = 0.1
    assert stale(records(**lagged(**tis(ess, 0.0)))) == []
    truncated = [0.0] * N
    truncated[-1] = 0.9  # the last step alone, though it is half of the last window
    assert stale(records(**lagged(**tis(0.95, truncated)))) == []


def test_persistence_over_the_whole_run_or_its_last_window():
    # 3 failing steps spread over 19 stale ones: 16% of the run, at most one in the last window (4 steps).
    spread = [0.95] * N
    for i in (4, 10, 16):
        spread[i] = 0.3
    assert stale(records(**lagged(**tis(spread, 0.0)))) == []
    spread[7] = 0.3  # a fourth: 4 of 19 stale steps is over stale_step_share (0.2)
    assert len(stale(records(**lagged(**tis(spread, 0.0))))) == 1
    rec = records(**lagged(**tis(spread, 0.0)))
    assert "stale_rollouts" not in diagnose_records(rec, TH.with_overrides({"stale_step_share": 0.25})).ids()
    # The same 3 failures at the end: a correction that started failing late is seen in the last window.
    late = [0.95] * (N - 3) + [0.3] * 3
    f, = stale(records(**lagged(**tis(late, 0.0))))
    assert f.steps == [18, 19, 20]
    # Failures on the unstale first step do not count: only stale steps are judged.
    first = [0.3] + [0.95] * (N - 1)
    assert stale(records(**lagged(**tis(first, 0.0)))) == []
    assert stale(records(**lagged(**tis(0.3, 0.0)))) != []
    assert stale(records(n=3, **lagged(n=3, k=0, **tis(0.3, 0.0, n=3)))) == []  # nothing stale: nothing to judge


def test_an_uncorrected_lagged_run_warns():
    f, = stale(records(reward__mean=0.5, **lagged()))
    assert f.severity == "warning" and f.steps == [2] and f.confidence == "high"
    assert f.what.startswith("rollout.staleness_correction=none: stale batches are trained on uncorrected")
    assert "up to 2 optimiser step(s)" in f.what and f.evidence["staleness_max"] == 2
    assert "rollout.staleness_correction=tis" in f.knob and "m2po" in f.knob


def test_an_m2po_corrected_lagged_run_is_not_called_uncorrected():
    rec = records(**lagged(m2po__masked_frac=0.01, m2po__m2=0.02, m2po__m2_kept=0.01))
    diag = diagnose_records(rec)
    assert "stale_rollouts" in diag.passed and "stale_rollouts" not in diag.ids()
