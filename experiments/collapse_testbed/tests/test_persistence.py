"""The persistence endpoints and seed-level tests (persistence.py) on hand-computed cases."""

from __future__ import annotations

import json
import math

import pytest

from experiments.collapse_testbed import persistence as P


def _curve(values: list[float], every: int = 8) -> list[tuple[int, float]]:
    return [(i * every, v) for i, v in enumerate(values)]


def test_sign_flip_p_three_seeds_by_hand():
    # d = (3, 1, -1), |sum| = 3; the 8 sign vectors give sums 3, -3, 1, 5, -5, -1, 3, -3: six have |T| >= 3
    assert P.sign_flip_p([3.0, 1.0, -1.0]) == pytest.approx(6 / 8)
    # all of one sign: only the observed vector and its mirror reach |sum| = 7
    assert P.sign_flip_p([1.0, 2.0, 4.0]) == pytest.approx(2 / 8)
    assert P.sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    assert math.isnan(P.sign_flip_p([]))


def test_mcnemar_exact_by_hand():
    assert P.mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert P.mcnemar_exact(4, 1) == pytest.approx(2 * (1 + 5) / 32)
    assert P.mcnemar_exact(3, 3) == 1.0
    assert P.mcnemar_exact(0, 0) == 1.0


def test_holm_hand_case():
    from meshrl.stats import holm_correction

    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01, 2 x 0.03, max(0.06, 0.04): [0.03, 0.06, 0.06] in input order
    adjusted, _ = holm_correction([0.01, 0.04, 0.03])
    assert list(adjusted) == pytest.approx([0.03, 0.06, 0.06])


def test_relearn_time_after_the_dip_and_censoring():
    # the dip's minimum at 24, back to >= 0.5 at 48
    assert P.relearn_time(_curve([0.4, 0.3, 0.1, 0.05, 0.2, 0.4, 0.6, 0.9])) == (48, False)
    # >= 0.5 at step 8 before the dip does not count: re-learned at 32
    assert P.relearn_time(_curve([0.4, 0.6, 0.1, 0.3, 0.7])) == (32, False)
    # never dips below the line in the window: the window's first checkpoint
    assert P.relearn_time(_curve([0.4, 0.7, 0.6, 0.8, 0.9, 0.9])) == (8, False)
    # never back: censored at the horizon
    lost = _curve([0.4, 0.2, 0.05] + [0.1] * 18)
    assert lost[-1][0] == 160 and P.relearn_time(lost) == (160, True)


def test_borderline_band_counts_neither_way():
    assert [P.outcome(v) for v in (0.39, 0.4, 0.5, 0.6, 0.61)] == ["lost", "borderline", "borderline", "borderline",
                                                                    "kept"]
    assert P.outcome(math.nan) == "missing"
    arm = [P.endpoints("W", "cp_only", s, _curve([0.4] + [v] * 20)) for s, v in enumerate((0.45, 0.1, 0.9))]
    base = [P.endpoints("W", "grpo", s, _curve([0.4] + [v] * 20)) for s, v in enumerate((0.9, 0.9, 0.1))]
    res = P.compare(P.pairs(arm + base, "cp_only", "grpo", ["W"]), "kept")
    # seed 0 (borderline vs kept) is no discordant pair; seed 1: GRPO only, seed 2: the arm only
    assert (res["n"], res["arm_only"], res["base_only"]) == (3, 1, 1)
    assert res["counts"] == [[1, 1], [2, 1]]


def test_area_under_the_niche_curve():
    curve = [(0, 0.0), (80, 1.0), (160, 1.0)]
    assert P.niche_auc(curve) == pytest.approx((80 * 0.5 + 80 * 1.0) / 160)
    assert math.isnan(P.niche_auc(curve[1:]))  # no step-0 point


def test_harm_dip_and_none_on_synthetic_curves():
    held = [0.4, 0.9, 0.9]
    # one checkpoint 0.3 below the running maximum, then back: a transient dip
    assert P.harm_class(_curve(held + [0.6, 0.9] + [0.9] * 16)) == ("dip", None)
    # two in a row: harm, from the first of them
    assert P.harm_class(_curve(held + [0.7, 0.6, 0.9] + [0.9] * 15)) == ("harm", 24)
    # exactly 0.2 below counts
    assert P.harm_class(_curve(held + [0.7, 0.7] + [0.9] * 16))[0] == "harm"
    # no large fall, but lost at the horizon: harm from where it stays below the band
    slow = _curve([0.45, 0.42, 0.41] + [0.38] * 18)
    assert P.harm_class(slow) == ("harm", 24)
    assert P.harm_class(_curve([0.4, 0.5, 0.6] + [0.7] * 18)) == ("none", None)


def test_the_early_dip_is_harm_verbatim_but_not_after_hold():
    early = _curve([0.4, 0.2, 0.05, 0.1, 0.5] + [0.9] * 16)
    assert P.harm_class(early) == ("harm", 8)
    assert P.harm_class(early, held_from=P.KEPT_AT) == ("none", None)
    late = _curve([0.4, 0.2, 0.05, 0.1, 0.5] + [0.9] * 8 + [0.0] * 8)
    assert P.harm_class(late, held_from=P.KEPT_AT) == ("harm", 104)


def test_primary_family_pools_the_warm_starts_and_holm_corrects():
    lost = _curve([0.4] + [0.05] * 20)
    kept = _curve([0.4, 0.2, 0.1, 0.3, 0.4, 0.6] + [0.9] * 15)
    runs = [P.endpoints(w, arm, s, lost if arm == "cp_only" else kept)
            for w in ("W1", "W2", "W3") for s in range(6) for arm in ("cp_only", "grpo")]
    rows = [r for r in P.comparisons(runs, ["W1", "W2", "W3"]) if r["family"] == "primary"]
    assert [r["endpoint"] for r in rows] == list(P.ENDPOINTS) and all(r["n"] == 18 for r in rows)
    # every one of the 18 pairs differs the same way: p = 2 / 2^18 for each test, Holm x 4 (all equal)
    assert all(r["p"] == pytest.approx(2 / 2**18) for r in rows)
    assert all(r["p_holm"] == pytest.approx(8 / 2**18) for r in rows)
    relearn = next(r for r in rows if r["endpoint"] == "relearn")
    assert relearn["mean_diff"] == 160 - 40
    # per warm start (secondary): 6 pairs, p = 2 / 64 at best
    per_warm = [r for r in P.comparisons(runs, ["W1", "W2", "W3"]) if r["scope"] == "W1" and r["endpoint"] == "final"]
    assert per_warm[0]["p"] == pytest.approx(2 / 64)


def _write_eval(path, decade: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "eval.json").write_text(json.dumps({"by": {"groups": {"decade": {"pass@1": decade}}}}))


def test_a_partial_directory_reports_runs_per_arm(tmp_path):
    (tmp_path / "settings.json").write_text(json.dumps({"task": "testbed:add"}))
    _write_eval(tmp_path / "warm_eval" / "seed_0", 0.4)
    for step in range(8, 161, 8):
        _write_eval(tmp_path / "runs" / "grpo" / "seed_0" / "ckpt_eval" / f"step_{step}", 0.9)
    for step in range(8, 81, 8):  # stopped half way
        _write_eval(tmp_path / "runs" / "cp_only" / "seed_0" / "ckpt_eval" / f"step_{step}", 0.1)
    (tmp_path / "runs" / "cp_only" / "seed_1").mkdir(parents=True)  # started, nothing evaluated yet
    runs, rows = P.analyse({"W2": tmp_path})
    summary = {a["arm"]: a for a in P.arm_summary(runs)}
    assert (summary["grpo"]["runs"], summary["grpo"]["complete"]) == (1, 1)
    assert (summary["cp_only"]["runs"], summary["cp_only"]["complete"]) == (1, 0)
    assert summary["grpo"]["auc"] == pytest.approx((8 * (0.4 + 0.9) / 2 + 152 * 0.9) / 160)
    primary = [r for r in rows if r["family"] == "primary"]
    assert all(r["n"] == 0 for r in primary) and all(math.isnan(r["p"]) for r in primary)
    md = P.markdown(runs, rows)
    assert "| W2 | cp_only | 1 (0) |" in md and "| W2 | grpo | 1 (1) |" in md


def test_runs_evaluated_differently_are_not_paired():
    curve = _curve([0.4] + [0.9] * 20)
    runs = [P.endpoints("W", "cp_only", 0, curve, evaluated="seed=0 limit=128"),
            P.endpoints("W", "grpo", 0, curve, evaluated="seed=0 limit=256")]
    with pytest.raises(ValueError, match="evaluated differently"):
        P.pairs(runs, "cp_only", "grpo", ["W"])


def test_decisions_count_persistent_losses_and_relearning_over_warm_starts():
    lost = _curve([0.4] + [0.05] * 20)
    back = _curve([0.4, 0.1] + [0.9] * 19)
    runs = [P.endpoints("W1", "cp_only", 0, lost), P.endpoints("W2", "cp_only", 0, back),
            P.endpoints("W1", "grpo", 0, back)]
    rows = {d["arm"]: d for d in P.decisions(runs)}
    assert (rows["cp_only"]["complete"], rows["cp_only"]["persistent_loss"], rows["cp_only"]["relearned"]) == (2, 1, 1)
    assert rows["grpo"]["persistent_loss"] == 0 and rows["grpo"]["persistent_loss_ci"][0] == 0.0


def test_a_loss_still_rising_at_the_end_is_not_persistent():
    flat = P.endpoints("W", "grpo", 0, _curve([0.4] + [0.05] * 20))
    rising = P.endpoints("W", "grpo", 1, _curve([0.4] + [0.05] * 18 + [0.2, 0.35]))
    assert flat.persistent_loss and flat.at_horizon == "lost"
    assert rising.at_horizon == "lost" and not rising.persistent_loss  # 0.35 - 0.05 >= 0.2 since step 144


def test_warm_dirs_are_checked_before_any_work(tmp_path, capsys):
    from experiments._args import named_dirs
    from experiments.collapse_testbed import mei_harm, persistence

    (tmp_path / "a" / "runs").mkdir(parents=True)
    assert named_dirs([f"W1={tmp_path / 'a'}"]) == {"W1": tmp_path / "a"}
    for bad, message in ([f"{tmp_path / 'a'}"], "WARM=DIR"), ([f"W1={tmp_path / 'a'}", f"W1={tmp_path}"], "W1 names"), \
            ([f"W1={tmp_path}"], "no runs in"):
        with pytest.raises(ValueError, match=message):
            named_dirs(bad)
        for cli in (persistence, mei_harm):
            assert cli.main([*bad, "--out", str(tmp_path / "x.md")]) == 2
            assert message in capsys.readouterr().err
