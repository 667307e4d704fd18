"""Group advantages (GRPO, Dr. GRPO) and DAPO reward shapers against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algos import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    group_advantages,
    group_index,
    overlong_penalty,
)

FAST = settings(max_examples=50, deadline=None)
EPS = 1e-6  # group_advantages' default eps


def t64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# --- group_advantages, scale="std" ------------------------------------------------------------------


def test_std_scale_uses_unbiased_std_plus_eps() -> None:
    # Group [1, 2, 3, 6]: mean 3, deviations -2, -1, 0, 3, squared sum 4 + 1 + 0 + 9 = 14,
    # unbiased variance 14 / 3, std sqrt(14/3) = 2.1602...; A = dev / (std + 1e-6).
    adv = group_advantages(t64([1, 2, 3, 6]), [0, 0, 0, 0])
    std = math.sqrt(14 / 3)
    expected = [d / (std + EPS) for d in (-2, -1, 0, 3)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-12)


def test_std_scale_binary_group_is_not_population_std() -> None:
    # [1, 0]: mean 0.5, deviations +-0.5, unbiased variance (0.25 + 0.25) / 1 = 0.5, std 0.70710678.
    # A population (n) std would give 0.5 and advantages +-1, so this pins the n - 1 estimator.
    adv = group_advantages(t64([1, 0]), ["q", "q"])
    a = 0.5 / (math.sqrt(0.5) + EPS)  # 0.70710578...
    assert adv.tolist() == pytest.approx([a, -a], rel=1e-12)
    assert abs(adv[0].item() - 1.0) > 0.2


def test_eps_is_added_to_the_std_not_the_variance() -> None:
    # [0, 2]: deviations +-1, std sqrt(2); with eps = 1: A = +-1 / (sqrt(2) + 1) = +-0.41421356.
    adv = group_advantages(t64([0, 2]), [0, 0], eps=1.0)
    a = 1 / (math.sqrt(2) + 1)
    assert adv.tolist() == pytest.approx([-a, a], rel=1e-12)


def test_scale_none_is_the_plain_centred_reward() -> None:
    # Same group as above, no division: r - mean = [-2, -1, 0, 3].
    adv = group_advantages(t64([1, 2, 3, 6]), [0, 0, 0, 0], scale="none")
    assert adv.tolist() == [-2.0, -1.0, 0.0, 3.0]


@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_of_one_gets_zero(scale: str) -> None:
    # "a" has one rollout (nothing to compare); "b" = [1, 3]: mean 2, deviations -1, +1, std sqrt(2).
    adv = group_advantages(t64([5, 1, 3]), ["a", "b", "b"], scale=scale)
    b = 1.0 if scale == "none" else 1 / (math.sqrt(2) + EPS)
    assert adv.tolist() == pytest.approx([0.0, -b, b], rel=1e-12)


def test_non_contiguous_string_labels_match_rows_by_label() -> None:
    # q1 rows 0, 2, 4 = [1, 0, 2]: mean 1, deviations [0, -1, 1], variance 2 / 2 = 1, std 1.
    # q2 rows 1, 3   = [10, 20]: mean 15, deviations [-5, 5], variance 50, std 7.0710678.
    adv = group_advantages(t64([1, 10, 0, 20, 2]), ["q1", "q2", "q1", "q2", "q1"])
    a1 = 1 / (1 + EPS)
    a2 = 5 / (math.sqrt(50) + EPS)
    assert adv.tolist() == pytest.approx([0.0, -a2, -a1, a2, a1], rel=1e-12)


def test_integer_tensor_labels_equal_string_labels() -> None:
    rewards = t64([0.5, 3.0, 1.5, -1.0])
    by_tensor = group_advantages(rewards, torch.tensor([7, 3, 7, 3]))
    by_string = group_advantages(rewards, ["x", "y", "x", "y"])
    # Each group has two rows: deviations +-0.5 and +-2, stds sqrt(0.5) and sqrt(8).
    a, b = 0.5 / (math.sqrt(0.5) + EPS), 2 / (math.sqrt(8) + EPS)
    assert by_tensor.tolist() == pytest.approx([-a, b, a, -b], rel=1e-12)
    assert torch.equal(by_tensor, by_string)


def test_integer_rewards_are_not_truncated() -> None:
    # 0/1 correctness as a long tensor: [0, 1, 1, 0], mean 0.5, variance (4 * 0.25) / 3 = 1/3,
    # A = +-0.5 / (sqrt(1/3) + eps) = +-0.8660. A cast back to long would make every advantage 0.
    adv = group_advantages(torch.tensor([0, 1, 1, 0]), [0, 0, 0, 0])
    assert adv.is_floating_point()
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert adv.tolist() == pytest.approx([-a, a, a, -a], rel=1e-6)


def test_bool_rewards_are_accepted() -> None:
    adv = group_advantages(torch.tensor([True, False]), [0, 0], scale="none")
    assert adv.tolist() == [0.5, -0.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_float_dtype_is_preserved(dtype: torch.dtype) -> None:
    assert group_advantages(torch.tensor([0.0, 1.0], dtype=dtype), [0, 0]).dtype == dtype


@pytest.mark.parametrize("value", [0.1, 0.7, 1 / 3, 5.0])
@pytest.mark.parametrize("n", [2, 3, 7])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_all_equal_group_gets_exactly_zero(value: float, n: int, eps: float) -> None:
    # (0.1 + 0.1 + 0.1) / 3 != 0.1 in binary floating point: a tiny residue over a tiny std must not
    # become an O(1) advantage (eps = 0) or a NaN (0 / 0).
    adv = group_advantages(torch.full((n,), value, dtype=torch.float64), [0] * n, eps=eps)
    assert adv.tolist() == [0.0] * n


def test_empty_batch_gives_empty_advantages() -> None:
    out = group_advantages(torch.zeros(0), [])
    assert out.shape == (0,)


# --- Dr. GRPO and the registry --------------------------------------------------------------------


def test_dr_grpo_advantages_hand_computed() -> None:
    # g0 = [1, 0, 0]: mean 1/3 -> [2/3, -1/3, -1/3];  g1 = [4, 8]: mean 6 -> [-2, 2].
    adv = dr_grpo_advantages(t64([1, 4, 0, 8, 0]), ["g0", "g1", "g0", "g1", "g0"])
    assert adv.tolist() == pytest.approx([2 / 3, -2.0, -1 / 3, 2.0, -1 / 3], rel=1e-12)


def test_registry_holds_grpo_and_dr_grpo() -> None:
    assert {"grpo", "dr_grpo"} <= set(ADVANTAGE_ESTIMATORS)
    assert advantage_estimator("grpo") is group_advantages
    assert advantage_estimator("dr_grpo") is dr_grpo_advantages


def test_unknown_advantage_estimator_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"advantage estimator.*'nope'.*dr_grpo.*grpo"):
        advantage_estimator("nope")


def test_group_index_is_first_seen_order() -> None:
    assert group_index(["b", "a", "b", "c", "a"], 5).tolist() == [0, 1, 0, 2, 1]
    assert group_index(torch.tensor([9, 9, 2]), 3).tolist() == [0, 0, 1]


# --- dynamic sampling -----------------------------------------------------------------------------


def test_dynamic_sampling_keeps_only_groups_with_different_rewards() -> None:
    # a = [1, 1] all equal -> drop; b = [0, 1] mixed -> keep; c = [0.5, 0.5] -> drop;
    # d = [3] a group of one -> drop. Rows are interleaved to check matching by label.
    rewards = t64([1, 0, 0.5, 1, 1, 0.5, 3])
    ids = ["a", "b", "c", "a", "b", "c", "d"]
    assert dynamic_sampling_mask(rewards, ids).tolist() == [False, True, False, False, True, False, False]


def test_dynamic_sampling_accepts_tensor_labels_and_empty_batches() -> None:
    mask = dynamic_sampling_mask(torch.tensor([0, 0, 1, 0]), torch.tensor([5, 5, 6, 6]))
    assert mask.tolist() == [False, False, True, True]
    assert dynamic_sampling_mask(torch.zeros(0), []).shape == (0,)


def test_dynamic_sampling_agrees_with_nonzero_advantages() -> None:
    # A kept group is exactly one that carries a non-zero advantage.
    rewards = t64([1, 1, 0, 2, 7, 7, 7, 4])
    ids = [0, 0, 1, 1, 2, 2, 2, 3]
    kept = dynamic_sampling_mask(rewards, ids)
    adv = group_advantages(rewards, ids)
    assert torch.equal(kept, adv != 0)


# --- DAPO soft overlong punishment ----------------------------------------------------------------


def test_overlong_penalty_each_branch() -> None:
    # L_max = 20, L_cache = 4, so the safe length is 16.
    #   |y| <= 16      -> 0                        (0, 16)
    #   16 < |y| <= 20 -> (16 - |y|) / 4           (17 -> -0.25, 18 -> -0.5, 19 -> -0.75, 20 -> -1)
    #   |y| > 20       -> -1                       (21, 100)
    lengths = torch.tensor([0, 16, 17, 18, 19, 20, 21, 100])
    pen = overlong_penalty(lengths, max_len=20, cache_len=4)
    assert pen.tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert pen.dtype == torch.float32


def test_overlong_penalty_factor_scales_the_penalty() -> None:
    pen = overlong_penalty(torch.tensor([10, 18, 30]), max_len=20, cache_len=4, factor=0.5)
    assert pen.tolist() == [0.0, -0.25, -0.5]


def test_overlong_penalty_cache_equal_to_max_len() -> None:
    # Safe length 0: every token costs 1 / L_cache = 0.1.
    pen = overlong_penalty(torch.tensor([0, 1, 5, 10, 11]), max_len=10, cache_len=10)
    assert pen.tolist() == pytest.approx([0.0, -0.1, -0.5, -1.0, -1.0])


@pytest.mark.parametrize(
    ("max_len", "cache_len", "factor", "match"),
    [(10, 0, 1.0, "cache_len"), (10, 11, 1.0, "cache_len"), (10, -1, 1.0, "cache_len"), (10, 2, -1.0, "factor")],
)
def test_overlong_penalty_rejects_bad_config(max_len: int, cache_len: int, factor: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        overlong_penalty(torch.tensor([1, 2]), max_len=max_len, cache_len=cache_len, factor=factor)


def test_overlong_penalty_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(torch.tensor([[1, 2]]), max_len=10, cache_len=2)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(torch.tensor([1.0, float("nan")]), max_len=10, cache_len=2)


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [group_advantages, dr_grpo_advantages, dynamic_sampling_mask])
def test_rejects_bad_rewards_and_labels(fn) -> None:
    with pytest.raises(ValueError, match="rewards"):
        fn(torch.zeros(2, 2), [0, 0])
    with pytest.raises(ValueError, match="rewards"):
        fn(t64([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="rewards"):
        fn(t64([1.0, float("inf")]), [0, 0])
    with pytest.raises(ValueError, match="rewards"):
        fn([1.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match="group_ids"):
        fn(t64([1.0, 0.0, 1.0]), [0, 0])
    with pytest.raises(ValueError, match="group_ids"):
        fn(t64([1.0, 0.0]), torch.zeros(2, 1))


def test_rejects_unknown_scale_and_negative_eps() -> None:
    with pytest.raises(ValueError, match=r"scale.*'mad'.*none.*std"):
        group_advantages(t64([1, 0]), [0, 0], scale="mad")
    with pytest.raises(ValueError, match="eps"):
        group_advantages(t64([1, 0]), [0, 0], eps=-1e-3)
    with pytest.raises(ValueError, match="eps"):
        group_advantages(t64([1, 0]), [0, 0], eps=float("nan"))


# --- properties -----------------------------------------------------------------------------------

rewards_and_groups = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-10, 10, allow_nan=False), min_size=n, max_size=n),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
    )
)


@FAST
@given(rewards_and_groups, st.sampled_from(["std", "none"]))
def test_property_advantages_sum_to_zero_per_group(data, scale: str) -> None:
    rewards, ids = data
    adv = group_advantages(t64(rewards), ids, scale=scale)
    for g in set(ids):
        rows = [i for i, x in enumerate(ids) if x == g]
        assert abs(sum(adv[i].item() for i in rows)) < 1e-6 * max(1, len(rows))


@FAST
@given(rewards_and_groups, st.floats(-100, 100, allow_nan=False), st.sampled_from(["std", "none"]))
def test_property_shift_invariance(data, shift: float, scale: str) -> None:
    rewards, ids = data
    base = group_advantages(t64(rewards), ids, scale=scale)
    shifted = group_advantages(t64(rewards) + shift, ids, scale=scale)
    # Adding c can make two almost-equal rewards exactly equal (rounding); then the group is all-equal
    # and gets 0 where the unshifted one got at most |dev| / eps ~ 1e-14 / 1e-6. Tolerance covers that.
    torch.testing.assert_close(shifted, base, atol=1e-6, rtol=1e-6)


@FAST
@given(rewards_and_groups, st.floats(1e-3, 1e3))
def test_property_std_scaling_is_exact_with_rescaled_eps(data, c: float) -> None:
    # (c r - c mean) / (c std + eps) = (r - mean) / (std + eps / c): an identity, not an approximation.
    rewards, ids = data
    scaled = group_advantages(t64(rewards) * c, ids, eps=1e-6)
    reference = group_advantages(t64(rewards), ids, eps=1e-6 / c)
    torch.testing.assert_close(scaled, reference, atol=1e-8, rtol=1e-8)


@FAST
@given(
    st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=2, max_size=10),
    st.floats(0.1, 10),
)
def test_property_std_mode_is_scale_invariant_up_to_eps(rewards: list[float], c: float) -> None:
    # Distinct rewards differ by >= 0.25, so any non-constant group has std >= 0.25 / sqrt(2) ~ 0.18 and
    # eps = 1e-6 moves A by a relative amount of at most ~1e-5 / min(c, 1).
    ids = [i % 2 for i in range(len(rewards))]
    base = group_advantages(t64(rewards), ids)
    scaled = group_advantages(t64(rewards) * c, ids)
    torch.testing.assert_close(scaled, base, atol=1e-4, rtol=1e-4)


@FAST
@given(rewards_and_groups, st.randoms(use_true_random=False))
def test_property_permuting_rows_permutes_advantages(data, rnd) -> None:
    rewards, ids = data
    perm = list(range(len(ids)))
    rnd.shuffle(perm)
    adv = group_advantages(t64(rewards), ids)
    adv_perm = group_advantages(t64([rewards[i] for i in perm]), [ids[i] for i in perm])
    torch.testing.assert_close(adv_perm, adv[perm], atol=1e-12, rtol=1e-12)


@FAST
@given(rewards_and_groups)
def test_property_std_advantages_have_unit_unbiased_std(data) -> None:
    # With eps -> 0, each non-constant group's advantages have unbiased std (std / (std + eps)) ~ 1.
    rewards, ids = data
    adv = group_advantages(t64(rewards), ids, eps=0.0)
    for g in set(ids):
        rows = [i for i, x in enumerate(ids) if x == g]
        vals = [rewards[i] for i in rows]
        if len(rows) < 2 or max(vals) - min(vals) < 1e-6:
            continue
        a = [adv[i].item() for i in rows]
        var = sum(x * x for x in a) / (len(a) - 1)  # advantages already have mean 0
        assert var == pytest.approx(1.0, rel=1e-6)
