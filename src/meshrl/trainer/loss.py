"""The loss of one micro-batch: the recipe's policy term (with the plug-ins), KL and JS penalties, extra terms.

:meth:`Objective.micro_loss` is the whole forward of a micro-batch; :meth:`Objective.token_loss` is the loss from
per-token log-probs and entropies alone, so that a process that did not run the forward (the parent of the update's
worker processes) computes the same metrics from what the workers send back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import aggregate, js_divergence, js_sampled, kl_penalty, masked_mean
from meshrl.trainer.batch import MicroBatch, micro_weight, token_entropy, token_logprobs
from meshrl.trainer.plugins import TokenTerms

# (per-token log-probs, entropies, exact JS or None), each [n, T], detached: what a part of a micro-batch sends back
TokenValues = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class MiniBatchSizes:
    """The mini-batch a micro-batch belongs to, for :func:`micro_weight` (exact gradient accumulation)."""

    tokens: int
    nonempty_rows: int
    rows: int

    @classmethod
    def of(cls, rows: list[int], data: Any) -> MiniBatchSizes:
        """Tokens and rows the loss aggregates over: the model's own tokens (``StepData.response_masks``)."""
        masks = getattr(data, "response_masks", None)
        lengths = [len(data.response_ids[j]) if not masks or (m := data.model_mask(j)) is None else sum(m)
                   for j in rows]
        return cls(sum(lengths), sum(1 for n in lengths if n > 0), len(rows))


@dataclass
class UpdateInputs:
    """What every micro-batch of one update reads: the step's rollouts and the per-row log-probs the update
    computed before its first optimiser step (``None``: not needed, e.g. one optimiser step per batch)."""

    data: Any  # StepData
    old_logps: list[torch.Tensor] | None
    ref_logps: list[torch.Tensor] | None
    step: int  # the step's index, 0-based


@dataclass
class MicroLoss:
    finite: bool
    loss: torch.Tensor  # the micro-batch's total loss, aggregated (not yet weighted)
    stats: dict[str, float]
    seq_logp: torch.Tensor  # [n] sum of response log-probs, with graph (for per-row weighted terms)
    values: TokenValues


def pad_rows(rows: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r.to(like.device)
    return out


def _not_finite(logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> MicroLoss:
    """A micro-batch with a non-finite log-prob: a NaN loss, so that the step is skipped."""
    return MicroLoss(False, torch.tensor(float("nan")), {}, (logp * mask).sum(-1), (logp.detach(), entropy, None))


def extra_loss_overridden(plugins: Any) -> bool:
    """Whether an enabled plug-in overrides ``extra_loss`` (which reads the whole logits)."""
    from meshrl.trainer.plugins import Plugin

    return any(getattr(type(p), "extra_loss", None) is not Plugin.extra_loss for p in getattr(plugins, "active", []))


class Objective:
    """The recipe's loss (``meshrl.algos``) with the run's plug-ins, for the policy's forward ``forward``."""

    def __init__(self, recipe: Any, cfg: Any, plugins: Any, forward: Any, mismatch: Any) -> None:
        self.recipe, self.plugins, self.forward, self.mismatch = recipe, plugins, forward, mismatch
        self.temperature = cfg.rollout.temperature
        self.norm_len = cfg.rollout.max_new_tokens
        # The whole logits are needed past the log-probs and entropies by exact JS and a plug-in's extra_loss.
        self.reads_logits = (recipe.js_coef > 0 and recipe.js_mode == "exact") or extra_loss_overridden(plugins)

    def micro_loss(self, rows: list[int], mb: MicroBatch, inputs: UpdateInputs,
                   on_logits: Callable[[list[int], torch.Tensor, MicroBatch], None] | None = None) -> MicroLoss:
        """Forward and loss of micro-batch ``rows``; ``on_logits`` sees the detached logits (MEI collection)."""
        rec, temp = self.recipe, self.temperature
        logits = None
        if on_logits is not None or self.reads_logits or not self.forward.chunks_head(self.forward.model):
            logits = self.forward.logits(self.forward.model, mb)
            logp, entropy = token_logprobs(logits, mb.response_ids, temp), token_entropy(logits.detach(), temp)
        else:  # nothing but the log-probs and entropies reads the logits: never hold them whole
            logp, entropy = self.forward.token_terms(self.forward.model, mb)
            assert entropy is not None
        mask = mb.response_mask
        if not bool(torch.isfinite(logp.detach()[mask > 0]).all()):  # skipped as a non-finite loss is
            return _not_finite(logp, entropy, mask)
        if on_logits is not None and logits is not None:
            on_logits(rows, logits.detach(), mb)
        js_mat = None
        if rec.js_coef > 0 and rec.js_mode == "exact" and logits is not None:
            with torch.no_grad():
                ref_logits = self.forward.reference_logits(mb)
            t = temp if temp > 0 else 1.0
            js_mat = js_divergence(logits / t, ref_logits / t)
        total, stats = self.token_loss(rows, mask, inputs, logp, entropy, js_mat)
        if logits is not None:
            total = self.plugins.extra_loss(mb, logits, total, stats)  # e.g. plugins.distill
        values = (logp.detach(), entropy, None if js_mat is None else js_mat.detach())
        return MicroLoss(True, total, stats, (logp * mask).sum(-1), values)

    def micro_loss_frozen(self, rows: list[int], mb: MicroBatch, inputs: UpdateInputs, frozen: set[int]) -> MicroLoss:
        """:meth:`micro_loss` with the rows at positions ``frozen`` forwarded without a graph. Their per-token values
        enter the loss as constants, so the plug-ins' terms, the aggregation's token counts and the metrics see the
        whole micro-batch as :meth:`micro_loss` does, and the backward runs over the other rows only. For rows
        whose gradient is exactly zero (advantage 0, a loss that is the policy term times factors): the same loss
        and gradient up to float rounding (the other rows' forward runs in a smaller batch). Not for a loss that
        reads the whole logits (:attr:`reads_logits`) or per-row graphs (a surrogate, balancing)."""
        data, width = inputs.data, mb.response_ids.shape[1]
        lengths = [len(data.response_ids[j]) for j in rows]
        logp = torch.zeros(len(rows), width, device=mb.response_ids.device)
        entropy = torch.zeros_like(logp)
        for grad in (True, False):
            ks = [k for k in range(len(rows)) if lengths[k] > 0 and (k in frozen) != grad]
            if not ks:
                continue
            sub = self.forward.collate([data.prompt_ids[rows[k]] for k in ks], [data.response_ids[rows[k]] for k in ks])
            with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
                sub_logp, sub_entropy = self.forward.token_terms(self.forward.model, sub)
            at = torch.tensor(ks, device=logp.device)
            pad = width - sub_logp.shape[1]
            logp = logp.index_copy(0, at, torch.nn.functional.pad(sub_logp, (0, pad)).to(logp.dtype))
            entropy = entropy.index_copy(0, at, torch.nn.functional.pad(sub_entropy, (0, pad)).to(entropy.dtype))
        mask = mb.response_mask
        if not bool(torch.isfinite(logp.detach()[mask > 0]).all()):
            return _not_finite(logp, entropy, mask)
        total, stats = self.token_loss(rows, mask, inputs, logp, entropy, None)
        return MicroLoss(True, total, stats, (logp * mask).sum(-1), (logp.detach(), entropy, None))

    def weighted(self, rows: list[int], mb: MicroBatch, result: MicroLoss, sizes: MiniBatchSizes) -> torch.Tensor:
        """The micro-batch's share of the mini-batch loss (:func:`micro_weight`) plus the plug-ins' per-row
        surrogates (e.g. DPO's, already weighted for the whole step)."""
        w = micro_weight(self.recipe.loss_agg, mb.response_mask, sizes.tokens, sizes.nonempty_rows, sizes.rows)
        return result.loss * w + self.plugins.surrogate(rows, result.seq_logp)

    def token_loss(self, rows: list[int], mask: torch.Tensor, inputs: UpdateInputs, logp: torch.Tensor,
                   entropy: torch.Tensor, js_mat: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """The recipe's loss and its metrics from per-token ``logp``, ``entropy`` and (exact JS) ``js_mat``."""
        rec = self.recipe
        old = logp.detach() if inputs.old_logps is None else pad_rows([inputs.old_logps[j] for j in rows], logp)
        self.mismatch.observe(rows, old, mask)  # pi_old of each row's first pass: the mismatch diagnostic
        loss_cfg: dict[str, Any] = {"clip_low": rec.clip_low, "clip_high": rec.clip_high}
        if rec.policy_loss == "ppo_clip":
            loss_cfg["clip_dual"] = rec.clip_dual
        terms = TokenTerms(step=inputs.step, rows=rows, loss_name=rec.policy_loss, logp=logp, old=old,
                           adv=inputs.data.advantages[rows].to(logp.device), mask=mask, entropy=entropy,
                           loss_cfg=loss_cfg, batch=inputs.data)
        pg_mat, pg_stats, pg_mask = self.plugins.policy_term(terms)
        pg = aggregate(pg_mat, pg_mask, rec.loss_agg, norm_len=self.norm_len)
        total = pg
        stats = {"loss/policy": float(pg.detach()), **{k: float(v) for k, v in pg_stats.items()}}
        stats["entropy/mean"] = float(masked_mean(entropy, mask))
        if rec.kl_coef > 0:
            ref = pad_rows([inputs.ref_logps[j] for j in rows], logp)
            kl = aggregate(kl_penalty(logp, ref, rec.kl_kind), mask, rec.loss_agg, norm_len=self.norm_len)
            total = total + rec.kl_coef * kl
            stats["kl/mean"] = float(kl.detach())
        if rec.js_coef > 0:
            if js_mat is None:
                js_mat = js_sampled(logp, pad_rows([inputs.ref_logps[j] for j in rows], logp))
            js = aggregate(js_mat, mask, rec.loss_agg, norm_len=self.norm_len)
            total = total + rec.js_coef * js
            stats["js/mean"] = float(js.detach())
        stats["loss/total"] = float(total.detach())
        return total, stats
