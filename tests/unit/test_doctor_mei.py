"""The paper's G/MEI readings: the mean over queries of G/MEI is dominated by one near-orthogonal group; the median
and G / mean(MEI) are not (hand-computed case). The bounded count the doctor and the report use is
``directions`` (tests/unit/test_effective_directions.py)."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.diagnostics import mei_key, mei_metrics


def test_median_and_g_over_mean_mei_by_hand():
    phi = torch.tensor([[1.0, 0.0], [1.0, 0.0],     # query 0: identical, MEI = 4 / 2 = 2, G/MEI = 1
                        [1.0, 0.0], [-1.0, 0.1],    # query 1: nearly opposite, MEI = 0.01 / 2.01, G/MEI = 402
                        [1.0, 0.0], [0.0, 1.0]])    # query 2: orthogonal, MEI = 1, G/MEI = 2
    out = mei_metrics(phi, [0, 0, 1, 1, 2, 2])
    mei_1 = 0.01 / 2.01
    assert out[mei_key("bias", "query")] == pytest.approx((2 + mei_1 + 1) / 3)
    assert out[mei_key("bias", "query", "g_over_mei")] == pytest.approx((1 + 2 / mei_1 + 2) / 3)  # ~135
    assert out[mei_key("bias", "query", "g_over_mei_median")] == pytest.approx(2.0)
    assert out[mei_key("bias", "query", "g_over_mei_of_mean")] == pytest.approx(2 / ((2 + mei_1 + 1) / 3))


def test_median_ignores_undefined_groups_and_even_counts_average_the_middle():
    phi = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    out = mei_metrics(phi, [0, 0, 1, 1, 2, 2])  # query 2 has all-zero features: no MEI
    assert out[mei_key("bias", "query", "g_over_mei_median")] == pytest.approx((1 + 2) / 2)
    zero = mei_metrics(torch.zeros(2, 3), [0, 0])
    assert math.isnan(zero[mei_key("bias", "query", "g_over_mei_median")])
    assert math.isnan(zero[mei_key("bias", "query", "g_over_mei_of_mean")])
