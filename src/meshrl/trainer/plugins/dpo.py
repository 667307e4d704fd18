"""``plugins.dpo``: a DPO term on preference pairs formed online from each group's own rollouts.

The pairs (docs/plugins.md, "DPO on the group's own rollouts"): inside one advantage group, and among the
rows of that group that share the same prompt tokens (a Mesh group can hold several coach prefixes, and DPO
compares two answers to the same ``x``), a rollout that scored correct (task score >= ``CORRECT_AT``) is
*chosen* and one that did not is *rejected*:

- ``pairs="all"``: every correct x every wrong rollout of the group (``c * w`` pairs);
- ``pairs="best_worst"``: one pair per group, the correct rollout of highest shaped reward against the
  wrong one of lowest (ties: the first row).

A group without both a correct and a wrong rollout gives no pair. The loss is ``coef`` times the mean over
the step's pairs of :func:`meshrl.algos.preference.dpo_loss` (Rafailov et al. 2023), with sequence
log-probs (sums over response tokens at ``rollout.temperature``, as every term of the trainer) under the
policy and under the frozen reference.

Micro-batches may split a pair's two members, so the term is applied as the Mesh balancing term is
(docs/architecture.md): per-row weights ``w_i = d(coef * mean_pairs L) / d s_i`` are computed once per
step from the detached sequence log-probs ``s_i`` of the step's start policy, and each micro-batch adds the
surrogate ``sum_i w_i * s_i(theta)`` to its backward. Its gradient is ``sum_i w_i grad s_i``, which by the
chain rule is the exact gradient of ``coef * mean_pairs L`` wherever the parameters are the start ones: at
the first optimiser step of the batch (all of it with ``train.ppo_epochs=1, train.mini_batches=1``). Later
optimiser steps of the same batch (more epochs or mini-batches) reuse the start weights, and a mini-batch
carries only the weights of its own rows, so over one epoch the rows' contributions add up to the start
gradient once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import DPO_LOSSES, dpo_loss
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, register

PAIR_RULES = ("all", "best_worst")


@dataclass
class DpoConfig:
    enabled: bool = setting(False, help="add a DPO term on (correct, wrong) pairs of each group's own rollouts")
    beta: float = setting(0.1, gt=0, help="DPO's beta (Rafailov et al. 2023; TRL's default)")
    coef: float = setting(1.0, gt=0, help="weight of the DPO term added to the recipe's loss")
    pairs: str = setting("all", choices=PAIR_RULES,
                         help="all: every correct x every wrong rollout of a group; best_worst: one pair per group")
    loss_type: str = setting("sigmoid", choices=DPO_LOSSES, help="sigmoid (DPO) or hinge (SLiC-HF)")
    label_smoothing: float = setting(0.0, ge=0, lt=0.5, help="conservative DPO's eps (sigmoid only)")


@register
class Dpo(Plugin):
    """Per-row weights of the step at :meth:`begin_update`, a surrogate per micro-batch (module docstring)."""

    name = "dpo"
    Config = DpoConfig
    stage = Stage.EXTRA_LOSS
    order = 2.0
    token_level = False  # whole sequences: fine with the sequence-level losses
    needs_reference = True
    summary = "DPO on correct-vs-wrong pairs of each group's rollouts, frozen reference"

    def __init__(self, cfg: DpoConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self.weights: torch.Tensor | None = None

    @classmethod
    def check(cls, cfg: DpoConfig, run_cfg: Any) -> None:
        if cfg.label_smoothing != 0 and cfg.loss_type != "sigmoid":  # the hinge has no smoothed form
            raise ValueError(f"invalid plug-in setting(s): plugins.dpo.label_smoothing={cfg.label_smoothing!r} "
                             f"needs plugins.dpo.loss_type='sigmoid' (see docs/plugins.md)")

    def begin_update(self, data: Any, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> Stats:
        """Form the step's pairs and weights at the current (start) parameters; ``dpo/*`` metrics, of which
        ``dpo/term`` (``coef * dpo/loss``) is what the update adds to ``loss/total``. ``start_logps`` and
        ``ref_logps``: per-row token log-probs the update already has, or None to score them here."""
        self.weights = None
        if not len(data):
            return {}
        pairs, groups = form_pairs(data.group_ids, data.prompt_ids, data.scores, data.rewards, self.cfg.pairs)
        if not pairs:
            return {"dpo/pairs": 0.0, "dpo/groups": 0.0}
        rows = sorted({i for p in pairs for i in p})
        forward = self.ctx.forward
        with torch.no_grad():
            if start_logps is None:
                start_logps = forward.logps(forward.model, data)
            seq = _seq_logps(start_logps, len(data))
            if ref_logps is None:
                ref_logps = forward.ref_logps(data)
            ref_seq = _seq_logps(ref_logps, len(data))
        w, stats = dpo_row_weights(self.cfg, pairs, seq, ref_seq)
        stats["dpo/groups"] = float(groups)
        stats["dpo/rows"] = float(len(rows))
        stats["dpo/term"] = self.cfg.coef * stats["dpo/loss"]
        self.weights = w
        return stats

    def surrogate(self, rows: list[int], seq_logp: torch.Tensor) -> torch.Tensor | float:
        """``sum_{i in rows} w_i * seq_logp_i``: this micro-batch's share of the DPO gradient."""
        if self.weights is None:
            return 0.0
        w = self.weights[rows].to(device=seq_logp.device, dtype=seq_logp.dtype)
        return (w * seq_logp).sum()


def form_pairs(group_ids: list[Any], prompt_ids: list[list[int]], scores: list[float],
               rewards: torch.Tensor | None, rule: str) -> tuple[list[tuple[int, int]], int]:
    """``([(chosen row, rejected row), ...], groups that gave a pair)`` of a step's rows under ``rule``
    (see the module docstring); rows are paired only within one (group, prompt)."""
    from meshrl.runs.correct import is_correct

    if rule not in PAIR_RULES:
        raise ValueError(f"plugins.dpo.pairs must be one of {PAIR_RULES}, got {rule!r}")
    cells: dict[tuple[Any, tuple[int, ...]], list[int]] = {}
    for i, (g, p) in enumerate(zip(group_ids, prompt_ids, strict=True)):
        cells.setdefault((g, tuple(p)), []).append(i)
    pairs: list[tuple[int, int]] = []
    groups = 0
    for rows in cells.values():
        good = [i for i in rows if is_correct(scores[i])]
        bad = [i for i in rows if not is_correct(scores[i])]
        if not good or not bad:
            continue
        groups += 1
        if rule == "all":
            pairs.extend((c, r) for c in good for r in bad)
        else:  # max/min return the first of equal keys: ties go to the earliest row
            reward = (lambda i: float(rewards[i])) if rewards is not None else (lambda i: float(scores[i]))
            pairs.append((max(good, key=reward), min(bad, key=reward)))
    return pairs, groups


def dpo_row_weights(c: DpoConfig, pairs: list[tuple[int, int]], seq: torch.Tensor,
                    ref_seq: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-row weights ``w [N] = d(coef * mean_pairs L) / d seq`` at the detached sequence log-probs
    ``seq [N]`` (reference ``ref_seq [N]``), and the step's ``dpo/*`` metrics; all-zero weights and
    ``dpo/pairs`` 0 alone when there is no pair."""
    n = seq.shape[0]
    if not pairs:
        return torch.zeros(n, dtype=torch.float64), {"dpo/pairs": 0.0, "dpo/groups": 0.0}
    s = seq.detach().double().clone().requires_grad_(True)
    ref = ref_seq.detach().double()
    chosen = torch.tensor([a for a, _ in pairs])
    rejected = torch.tensor([b for _, b in pairs])
    losses, m = dpo_loss(s[chosen], s[rejected], ref[chosen], ref[rejected], beta=c.beta,
                         loss_type=c.loss_type, label_smoothing=c.label_smoothing)
    loss = losses.mean()
    (w,) = torch.autograd.grad(c.coef * loss, s)
    stats = {"dpo/pairs": float(len(pairs)), "dpo/loss": float(loss.detach()),
             "dpo/reward_margin": m["dpo/margin"], "dpo/accuracy": m["dpo/accuracy"],
             "dpo/chosen_reward": m["dpo/chosen_reward"], "dpo/rejected_reward": m["dpo/rejected_reward"]}
    return w, stats


def _seq_logps(per_token: list[torch.Tensor], n: int) -> torch.Tensor:
    return torch.tensor([float(per_token[i].double().sum()) for i in range(n)], dtype=torch.float64)
