"""Loss aggregation modes: hand-computed values, gradients, the identities between modes, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algos import AGG_MODES, aggregate, masked_mean

FAST = settings(max_examples=50, deadline=None)

# Three rows of T = 4: a full row, a half row (its masked-out entries hold junk that must not leak) and a
# padding row with no tokens at all.
LOSS = [[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0], [7.0, 7.0, 7.0, 7.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
# Masked sums per row: 10, 30, 0; lengths 4, 2, 0; 6 tokens; B = 3 rows, B' = 2 rows with tokens.
HAND = {
    "token-mean": 40 / 6,  # (10 + 30) / 6 tokens
    "token-sum": 40.0,
    "seq-mean-token-mean": (10 / 4 + 30 / 2) / 2,  # (2.5 + 15) / 2 = 8.75, the padding row is left out
    "seq-mean-token-sum": (10 + 30) / 2,  # 20
    "seq-mean-token-sum-norm": 40 / (3 * 4),  # sum / (B * T), B counts every row (constant normaliser)
}


def loss_and_mask() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(LOSS, dtype=torch.float64, requires_grad=True), torch.tensor(MASK)


def test_modes_are_the_five_documented_ones() -> None:
    assert set(AGG_MODES) == set(HAND)


@pytest.mark.parametrize("mode", sorted(HAND))
def test_hand_computed_value(mode: str) -> None:
    loss, mask = loss_and_mask()
    assert aggregate(loss, mask, mode).item() == pytest.approx(HAND[mode], rel=1e-12)


def test_default_mode_is_token_mean() -> None:
    loss, mask = loss_and_mask()
    assert aggregate(loss, mask).item() == pytest.approx(HAND["token-mean"])


def test_explicit_norm_len() -> None:
    # Dr. GRPO normalises by the generation budget, not the padded width: 40 / (3 * 10).
    loss, mask = loss_and_mask()
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(40 / 30)


# d aggregate / d loss_{i,t}: each masked token's weight in the reduction, 0 elsewhere.
HAND_GRAD = {
    "token-mean": [[1 / 6] * 4, [1 / 6, 1 / 6, 0, 0], [0] * 4],
    "token-sum": [[1.0] * 4, [1.0, 1.0, 0, 0], [0] * 4],
    "seq-mean-token-mean": [[1 / 8] * 4, [1 / 4, 1 / 4, 0, 0], [0] * 4],  # 1 / (B' L_i)
    "seq-mean-token-sum": [[1 / 2] * 4, [1 / 2, 1 / 2, 0, 0], [0] * 4],  # 1 / B'
    "seq-mean-token-sum-norm": [[1 / 12] * 4, [1 / 12, 1 / 12, 0, 0], [0] * 4],  # 1 / (B T)
}


@pytest.mark.parametrize("mode", sorted(HAND_GRAD))
def test_hand_computed_gradient(mode: str) -> None:
    loss, mask = loss_and_mask()
    (g,) = torch.autograd.grad(aggregate(loss, mask, mode), loss)
    torch.testing.assert_close(g, torch.tensor(HAND_GRAD[mode], dtype=torch.float64))


def test_bool_and_float_masks_agree() -> None:
    loss, mask = loss_and_mask()
    for mode in AGG_MODES:
        a = aggregate(loss, mask.bool(), mode)
        b = aggregate(loss, mask.to(torch.float32), mode)
        assert a.item() == pytest.approx(b.item())


# --- identities between modes ---------------------------------------------------------------------


def equal_length_case(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """4 rows, T = 6, each row with exactly 3 masked tokens in different positions."""
    loss = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.zeros(4, 6)
    for i in range(4):
        mask[i, torch.randperm(6, generator=gen)[:3]] = 1
    return loss, mask, 3


def test_identities_on_equal_length_rows(gen: torch.Generator) -> None:
    loss, mask, n = equal_length_case(gen)
    b, t = loss.shape
    v = {mode: aggregate(loss, mask, mode).item() for mode in AGG_MODES}
    # Equal lengths L: (1/B) sum_i (1/L) s_i = sum s / (B L) = token-mean.
    assert v["seq-mean-token-mean"] == pytest.approx(v["token-mean"], rel=1e-12)
    # Always (no padding rows): seq-mean-token-sum = token-sum / B = T * seq-mean-token-sum-norm.
    assert v["seq-mean-token-sum"] == pytest.approx(v["token-sum"] / b, rel=1e-12)
    assert v["seq-mean-token-sum"] == pytest.approx(t * v["seq-mean-token-sum-norm"], rel=1e-12)
    # token-sum = (number of tokens) * token-mean, and seq-mean-token-sum = L * seq-mean-token-mean.
    assert v["token-sum"] == pytest.approx(b * n * v["token-mean"], rel=1e-12)
    assert v["seq-mean-token-sum"] == pytest.approx(n * v["seq-mean-token-mean"], rel=1e-12)


def test_token_mean_and_seq_mean_differ_on_unequal_lengths() -> None:
    # Rows of lengths 1 and 3 with values 3 and [1, 1, 1]: token-mean = 6/4 = 1.5, but
    # seq-mean-token-mean = (3 + 1) / 2 = 2. The equal-length identity is not an accident of the code.
    loss = torch.tensor([[3.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(1.5)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)


def test_seq_mean_token_sum_norm_counts_padding_rows_but_seq_means_do_not() -> None:
    # Adding an empty row changes the constant normaliser B but not the seq means over B' rows.
    loss = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(1.5)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(3.0 / (2 * 2))


@FAST
@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.data(),
)
def test_property_token_mean_equals_seq_mean_token_mean_for_equal_lengths(b: int, t: int, data) -> None:
    n = data.draw(st.integers(1, t))
    values = data.draw(st.lists(st.floats(-100, 100), min_size=b * t, max_size=b * t))
    loss = torch.tensor(values, dtype=torch.float64).reshape(b, t)
    mask = torch.zeros(b, t)
    for i in range(b):
        cols = data.draw(st.permutations(range(t)))[:n]
        mask[i, list(cols)] = 1
    tm = aggregate(loss, mask, "token-mean").item()
    smtm = aggregate(loss, mask, "seq-mean-token-mean").item()
    assert smtm == pytest.approx(tm, rel=1e-9, abs=1e-9)


@FAST
@given(st.lists(st.lists(st.floats(-10, 10), min_size=3, max_size=3), min_size=1, max_size=4), st.data())
def test_property_masked_out_values_never_matter(rows, data) -> None:
    loss = torch.tensor(rows, dtype=torch.float64)
    mask = torch.tensor(
        data.draw(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=len(rows), max_size=len(rows)))
    )
    mask[0, 0] = True
    junk = torch.where(mask, loss, loss + 1e3)
    for mode in AGG_MODES:
        assert aggregate(junk, mask, mode).item() == pytest.approx(aggregate(loss, mask, mode).item())


# --- bad input ------------------------------------------------------------------------------------


def test_unknown_mode_lists_known_modes() -> None:
    loss, mask = loss_and_mask()
    with pytest.raises(ValueError, match=r"aggregation mode.*'seq-sum'.*seq-mean-token-mean.*token-mean"):
        aggregate(loss, mask, "seq-sum")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_zero_mask_is_an_error(mode: str) -> None:
    with pytest.raises(ValueError, match="mask"):
        aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode)


def test_rejects_bad_shapes_values_and_norm_len() -> None:
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\) != loss_mat shape \(2, 3\)"):
        aggregate(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask must contain only 0/1"):
        aggregate(torch.ones(2, 3), torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate(torch.tensor([[1.0, float("nan")]]), torch.ones(1, 2))
    # A NaN in a masked-out slot is still rejected: loss * 0 would be NaN and poison the sum.
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate(torch.tensor([[1.0, float("inf")]]), torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="mask"):
        aggregate(torch.ones(1, 2), torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm", norm_len=0)
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate([[1.0]], torch.ones(1, 1))


# --- masked_mean (metrics helper) -----------------------------------------------------------------


def test_masked_mean_hand_value_and_empty_mask() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    assert masked_mean(x, torch.tensor([[1, 1], [1, 0]])).item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0
