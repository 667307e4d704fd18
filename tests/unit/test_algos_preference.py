"""DPO and top-K forward-KL distillation: hand cases and gradients (DPO equal to TRL's DPOTrainer loss:
tests/integration/test_algos_preference_trl.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshrl.algos import DPO_LOSSES, dpo_loss, topk_forward_kl


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_dpo_sigmoid_hand_case_and_gradient() -> None:
    chosen = torch.tensor([-3.0, -5.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([-4.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref_c, ref_r = torch.tensor([-3.5, -5.0], dtype=torch.float64), torch.tensor([-3.0, -3.0], dtype=torch.float64)
    losses, metrics = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.1)
    # delta = (0.5) - (-1.0) = 1.5 and (0) - (1) = -1
    assert losses.tolist() == pytest.approx([-math.log(sig(0.15)), -math.log(sig(-0.1))])
    g_c, g_r = torch.autograd.grad(losses.sum(), (chosen, rejected))
    # dL/dchosen = -beta (1 - sigmoid(beta delta)), dL/drejected = +beta (1 - sigmoid(beta delta))
    assert g_c.tolist() == pytest.approx([-0.1 * (1 - sig(0.15)), -0.1 * (1 - sig(-0.1))])
    torch.testing.assert_close(g_r, -g_c)
    assert metrics["dpo/accuracy"] == 0.5
    assert metrics["dpo/margin"] == pytest.approx((0.15 - 0.1) / 2)
    assert metrics["dpo/chosen_reward"] == pytest.approx((0.05 + 0.0) / 2)


def test_dpo_label_smoothing_and_hinge() -> None:
    z = torch.zeros(1, dtype=torch.float64)
    c = torch.tensor([2.0], dtype=torch.float64)
    smooth, _ = dpo_loss(c, z, z, z, beta=0.5, label_smoothing=0.2)
    assert smooth.item() == pytest.approx(-0.8 * math.log(sig(1.0)) - 0.2 * math.log(sig(-1.0)))
    hinge, _ = dpo_loss(c, z, z, z, beta=0.1, loss_type="hinge")
    assert hinge.item() == pytest.approx(0.8)
    assert set(DPO_LOSSES) == {"sigmoid", "hinge"}
    with pytest.raises(ValueError, match="dpo beta"):
        dpo_loss(c, z, z, z, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(c, z, z, z, label_smoothing=0.5)
    with pytest.raises(ValueError, match="shape mismatch"):
        dpo_loss(c, torch.zeros(2), z, z)


def independent_topk_kl(logits, t_logps, t_ids, lo=-10.0, hi=10.0) -> list[list[float]]:
    """The formula position by position with Python floats."""
    out = []
    for b in range(logits.shape[0]):
        row = []
        for t in range(logits.shape[1]):
            z = logits[b, t].double()
            log_z = math.log(sum(math.exp(v) for v in z.tolist()))
            total = 0.0
            for k in range(t_ids.shape[-1]):
                lt = max(float(t_logps[b, t, k]), lo)
                ls = max(float(z[int(t_ids[b, t, k])]) - log_z, lo)
                total += math.exp(lt) * (lt - ls)
            row.append(min(max(total, 0.0), hi))
        out.append(row)
    return out


def test_topk_forward_kl_matches_independent_formula_with_holes() -> None:
    gen = torch.Generator().manual_seed(0)
    b, t, v, k = 2, 3, 11, 4
    student = torch.randn(b, t, v, generator=gen) * 3
    teacher_full = F.log_softmax(torch.randn(b, t, v, generator=gen) * 3, -1)
    t_logps, t_ids = torch.topk(teacher_full, k, dim=-1)
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    loss, metrics = topk_forward_kl(student.requires_grad_(), t_logps, t_ids, mask)
    want = torch.tensor(independent_topk_kl(student.detach(), t_logps, t_ids)) * mask
    torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=1e-5)
    (g,) = torch.autograd.grad(loss.sum(), student)
    assert g[1].abs().sum() == 0 and g[0, 1].abs().sum() == 0  # masked positions give no gradient
    assert 0 < metrics["distill/teacher_mass"] <= 1 and 0 < metrics["distill/student_mass"] <= 1
    assert 0 <= metrics["distill/overlap_ratio"] <= 1


def test_topk_forward_kl_is_zero_when_student_equals_teacher_and_checks_ids() -> None:
    logits = torch.randn(1, 2, 7, generator=torch.Generator().manual_seed(2))
    lp = F.log_softmax(logits, -1)
    t_logps, t_ids = torch.topk(lp, 7, dim=-1)  # full support: exactly KL(p || p) = 0
    loss, metrics = topk_forward_kl(logits, t_logps, t_ids, torch.ones(1, 2))
    assert loss.abs().max() < 1e-6
    assert metrics["distill/overlap_ratio"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        topk_forward_kl(logits, t_logps, t_ids + 7, torch.ones(1, 2))
