"""``plugins.calib`` (CalibRL's expert-calibrated term): the per-token term against a loop worked token by token,
the expert matrix, and bad settings named by key (the trainer's micro-batch loss and runs on the tiny model:
tests/integration/test_plugin_calib_train.py)."""

from __future__ import annotations

import pytest
import torch

from meshrl.trainer import load_config
from meshrl.trainer.plugins.calib import calib_term, expert_matrix


def test_term_equals_a_token_by_token_loop():
    g = torch.Generator().manual_seed(0)
    logp = -3 * torch.rand(4, 5, generator=g, dtype=torch.float64)
    expert = -3 * torch.rand(4, 5, generator=g, dtype=torch.float64)
    adv = torch.tensor([0.75, -0.25, 0.0, -1.5], dtype=torch.float64)
    passed = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    got, above = calib_term(logp, expert, adv, passed, negative_slope=0.5)
    for i in range(4):
        for t in range(5):
            d = float(logp[i, t] - expert[i, t])
            x = -d if passed[i] else d  # a correct rollout below the expert, a wrong one above: corrective side
            want = abs(float(adv[i])) * (x if x > 0 else 0.5 * x)
            assert float(got[i, t]) == pytest.approx(want, abs=1e-12)
            assert float(above[i, t]) == (1.0 if x > 0 else 0.0)
    # the gradient keeps its corrective direction on both sides: d term / d log pi = -|A| (correct) or +|A| (wrong)
    # times 1 or the slope
    lp = logp.clone().requires_grad_()
    calib_term(lp, expert, adv, passed, negative_slope=0.5)[0].sum().backward()
    assert (lp.grad[0] < 0).all() and (lp.grad[1] > 0).all() and (lp.grad[2] == 0).all()
    assert set(lp.grad[0].abs().tolist()) <= {0.75, 0.375}
    # a per-token advantage [n, T] works the same way
    tok_adv = adv[:, None].expand(4, 5)
    torch.testing.assert_close(calib_term(logp, expert, tok_adv, passed, negative_slope=0.5)[0], got)


def test_expert_matrix_covers_only_the_expert_positions():
    like = torch.zeros(3, 4)
    e, cov = expert_matrix([torch.tensor([-1.0, -2.0]), None, torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0])], like)
    assert e.tolist() == [[-1, -2, 0, 0], [0, 0, 0, 0], [-1, -2, -3, -4]]
    assert cov.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.calib.coef=0", "plugins.calib.coef"),
    ("plugins.calib.negative_slope=1.5", "plugins.calib.negative_slope"),
    ("plugins.calib.negative_slope=-0.1", "plugins.calib.negative_slope"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_a_missing_trace_file_is_refused():
    with pytest.raises(ValueError, match=r"plugins\.calib\.traces: no such file"):
        load_config(overrides=["plugins.calib.enabled=true", "plugins.calib.traces=/nonexistent.jsonl"])
