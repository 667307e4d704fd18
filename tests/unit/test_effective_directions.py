"""Effective directions (``directions``): the participation ratio ``tr(Phi)^2 / ||Phi||_F^2`` of a group's Gram
matrix, a count in [1, G], on constructed Gram matrices; the paper's G/MEI beside it where it is no count."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.diagnostics import gram_matrix, group_mei, mei_from_gram, mei_key, mei_metrics, participation_ratio


def test_orthogonal_equal_norms_give_g_and_copies_give_one():
    assert participation_ratio(torch.eye(6) * 2.5) == pytest.approx(6)
    same = torch.tensor([[1.0, 2.0, -1.0]]).repeat(5, 1)
    assert participation_ratio(gram_matrix(same)) == pytest.approx(1)


def test_equal_orthogonal_clusters_count_the_clusters():
    for c, size in ((2, 4), (3, 2), (4, 1)):
        feats = torch.eye(c).repeat_interleave(size, dim=0)  # c orthogonal directions, `size` copies each
        assert participation_ratio(gram_matrix(feats)) == pytest.approx(c)


def test_anti_aligned_rollouts_are_one_direction_where_g_over_mei_is_undefined_or_above_g():
    opposite = gram_matrix(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
    assert participation_ratio(opposite) == pytest.approx(1)
    assert mei_from_gram(opposite) == 0  # G / MEI: 2 / 0
    nearly = torch.tensor([[1.0, 0.0], [-1.0, 0.1]])  # Gram [[1, -1], [-1, 1.01]]
    assert participation_ratio(gram_matrix(nearly)) == pytest.approx(2.01 ** 2 / (1 + 1 + 1 + 1.01 ** 2))
    r = group_mei(nearly, [0, 0])
    assert r["g_over_mei"][0].item() == pytest.approx(402)  # the paper's reading: 402 "directions" of 2 rollouts
    assert 1 <= r["directions"][0].item() <= 2


def test_unequal_norms_count_less_than_the_orthogonal_features():
    # two orthogonal features of norms 1 and 3: eigenvalues 1 and 9, (1 + 9)^2 / (1 + 81) = 100 / 82
    gram = torch.diag(torch.tensor([1.0, 9.0]))
    assert participation_ratio(gram) == pytest.approx(100 / 82)


def test_bounded_by_the_rank_on_random_groups():
    gen = torch.Generator().manual_seed(0)
    for g in range(2, 12):
        for rank in (1, 2, g):
            feats = torch.randn(g, rank, generator=gen) @ torch.randn(rank, 16, generator=gen)
            pr = participation_ratio(gram_matrix(feats))
            assert 1 - 1e-9 <= pr <= min(rank, g) + 1e-9


def test_zero_group_is_undefined_and_metrics_carry_both_readings():
    assert math.isnan(participation_ratio(torch.zeros(3, 3)))
    phi = torch.tensor([[1.0, 0.0], [-1.0, 0.1], [1.0, 0.0], [0.0, 1.0]])
    out = mei_metrics(phi, [0, 0, 1, 1])
    pr0 = 2.01 ** 2 / (3 + 1.01 ** 2)
    assert out[mei_key("bias", "query", "directions")] == pytest.approx((pr0 + 2) / 2)
    assert out[mei_key("bias", "query", "directions_median")] == pytest.approx((pr0 + 2) / 2)
    assert out[mei_key("bias", "query", "g_over_mei")] == pytest.approx((402 + 2) / 2)
