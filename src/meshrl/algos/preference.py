"""Losses that learn from a comparison or a teacher rather than a reward: DPO (pairwise preference) and
top-K forward-KL distillation on the teacher's support. Pure tensor functions behind registries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshrl.algos._checks import check_choice, check_mask, check_same_shape, check_tensor

DPO_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {}


def register_dpo_loss(name: str) -> Callable:
    """Decorator: add ``fn(delta [B], beta, label_smoothing) -> per-pair loss [B]`` to :data:`DPO_LOSSES`."""

    def deco(fn: Callable) -> Callable:
        DPO_LOSSES[name] = fn
        return fn

    return deco


@register_dpo_loss("sigmoid")
def _dpo_sigmoid(delta: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    # Rafailov et al. 2023 eq. 7; label smoothing eps is the conservative DPO of Mitchell 2023 ("cDPO").
    return -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)


@register_dpo_loss("hinge")
def _dpo_hinge(delta: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    # SLiC-HF (Zhao et al. 2023) hinge on the same margin, as TRL's loss_type="hinge".
    return torch.relu(1 - beta * delta)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct Preference Optimization, per pair.

    Formula (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7; beta = 0.1 as TRL)::

        delta = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))
        L     = -log sigmoid(beta * delta)                     loss_type="sigmoid" (label_smoothing 0)
        L     = max(0, 1 - beta * delta)                       loss_type="hinge"

    ``label_smoothing = eps`` gives the conservative DPO of Mitchell 2023,
    ``-(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)``. Equal to TRL 1.16's
    ``DPOTrainer`` loss for ``sigmoid`` and ``hinge`` at ``label_smoothing = 0``; TRL 1.16's ``sigmoid`` does
    not read its ``label_smoothing``.

    Args:
        chosen_logps, rejected_logps: ``[B]`` sequence log-probs (sums over completion tokens) under the
            policy (require grad).
        ref_chosen_logps, ref_rejected_logps: ``[B]`` the same under the frozen reference.
    Returns:
        per-pair losses ``[B]`` and metrics ``dpo/margin`` (mean ``beta * delta``), ``dpo/accuracy``
        (share of pairs with ``delta > 0``), ``dpo/chosen_reward``, ``dpo/rejected_reward``.
    """
    for name, x in (("chosen_logps", chosen_logps), ("rejected_logps", rejected_logps),
                    ("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
        check_tensor(name, x, ndim=1)
    check_same_shape(chosen_logps=chosen_logps, rejected_logps=rejected_logps, ref_chosen_logps=ref_chosen_logps,
                     ref_rejected_logps=ref_rejected_logps)
    check_choice("dpo loss_type", loss_type, DPO_LOSSES)
    if not beta > 0:
        raise ValueError(f"dpo beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen = chosen_logps - ref_chosen_logps.detach()
    rejected = rejected_logps - ref_rejected_logps.detach()
    delta = chosen - rejected
    losses = DPO_LOSSES[loss_type](delta, beta, label_smoothing)
    d = delta.detach()
    metrics = {
        "dpo/margin": float((beta * d).mean()) if d.numel() else 0.0,
        "dpo/accuracy": float((d > 0).float().mean()) if d.numel() else 0.0,
        "dpo/chosen_reward": float((beta * chosen.detach()).mean()) if d.numel() else 0.0,
        "dpo/rejected_reward": float((beta * rejected.detach()).mean()) if d.numel() else 0.0,
    }
    return losses, metrics


def topk_forward_kl(
    student_logits: torch.Tensor,
    teacher_topk_logps: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    log_prob_min: float | None = -10.0,
    loss_max: float | None = 10.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward KL from the teacher to the student on the teacher's top-K tokens, per position.

    Formula (on-policy distillation, Agarwal et al. 2024 "On-Policy Distillation of Language Models" /
    GKD with beta = 0; top-K support and clamps as verl's ``forward_kl_topk``, K = 128 there)::

        L_t = clamp( sum_{v in TopK_T(t)} p_T(v) (c(log p_T(v)) - c(log p_S(v))), 0, loss_max )

    with ``c(x) = max(x, log_prob_min)`` and ``p_T = exp(c(log p_T))``. The truncated support can make the
    sum negative, hence the floor at 0. The student's log-probs are a full ``log_softmax`` of its logits.

    Args:
        student_logits: ``[B, T, V]`` (requires grad).
        teacher_topk_logps: ``[B, T, K]`` the teacher's log-probs of its top-K tokens.
        teacher_topk_ids: ``[B, T, K]`` their vocabulary ids.
        mask: ``[B, T]``.
    Returns:
        ``loss_mat [B, T]`` (0 where masked) and metrics ``distill/student_mass``, ``distill/teacher_mass``
        (mean probability mass on the teacher's top-K), ``distill/overlap_ratio`` (mean share of the
        teacher's top-K that is in the student's top-K).
    """
    check_tensor("student_logits", student_logits, ndim=3)
    check_tensor("teacher_topk_logps", teacher_topk_logps, ndim=3)
    if tuple(teacher_topk_ids.shape) != tuple(teacher_topk_logps.shape):
        raise ValueError(f"teacher_topk_ids shape {tuple(teacher_topk_ids.shape)} != teacher_topk_logps shape "
                         f"{tuple(teacher_topk_logps.shape)}")
    if tuple(student_logits.shape[:2]) != tuple(teacher_topk_logps.shape[:2]):
        raise ValueError(f"student_logits {tuple(student_logits.shape)} and teacher_topk_logps "
                         f"{tuple(teacher_topk_logps.shape)} differ in [B, T]")
    k, vocab = teacher_topk_ids.shape[-1], student_logits.shape[-1]
    if k > vocab or (teacher_topk_ids.numel() and (teacher_topk_ids.min() < 0 or teacher_topk_ids.max() >= vocab)):
        raise ValueError(f"teacher_topk_ids must be in [0, {vocab}) with K={k} <= vocabulary size")
    m = check_mask("mask", mask, student_logits[..., 0], "student_logits[..., 0]")
    student_all = F.log_softmax(student_logits.float(), dim=-1)
    student = student_all.gather(-1, teacher_topk_ids.long())
    teacher = teacher_topk_logps.detach().float()
    student_mass, teacher_mass = student.detach().exp().sum(-1), teacher.exp().sum(-1)
    if log_prob_min is not None:
        student, teacher = student.clamp_min(log_prob_min), teacher.clamp_min(log_prob_min)
    loss = (teacher.exp() * (teacher - student)).sum(-1).clamp_min(0.0)
    if loss_max is not None:
        loss = loss.clamp(max=loss_max)
    student_top = torch.topk(student_all.detach(), k, dim=-1).indices
    overlap = (teacher_topk_ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1).float().sum(-1) / k
    valid = m > 0
    n = float(m.sum().clamp(min=1))
    metrics = {
        "distill/student_mass": float((student_mass * m).sum()) / n,
        "distill/teacher_mass": float((teacher_mass * m).sum()) / n,
        "distill/overlap_ratio": float(overlap[valid].mean()) if valid.any() else 0.0,
    }
    return (loss * m).to(student_logits.dtype), metrics
