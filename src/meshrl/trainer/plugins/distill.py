"""``plugins.distill``: on-policy distillation, a top-K forward-KL term to a teacher model on the policy's own
rollouts (the loss of :func:`meshrl.algos.topk_forward_kl`, as verl's top-K distillation), ``coef`` times the
recipe's aggregation of it added to the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import aggregate, topk_forward_kl
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, register


@dataclass
class DistillConfig:
    enabled: bool = setting(False, help="add a top-K forward-KL term to a teacher model")
    teacher: str = setting("", help="the teacher: a local Hugging Face directory or a built-in model name (the "
                                    "policy's vocabulary)")
    teacher_seed: int = setting(0, help="weights of a built-in tiny teacher")
    topk: int = setting(128, ge=1, help="the teacher's top-K tokens per position (verl's default)")
    coef: float = setting(1.0, gt=0, help="weight of the distillation term in the loss")
    log_prob_min: float = setting(-10.0, help="both log-probs clamped from below (verl's log_prob_min_clamp)")
    loss_max: float = setting(10.0, gt=0, help="per-token loss clamped from above")


@register
class Distill(Plugin):
    name = "distill"
    Config = DistillConfig
    stage = Stage.EXTRA_LOSS
    order = 1.0
    summary = "on-policy distillation: top-K forward KL to a teacher"

    def __init__(self, cfg: DistillConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self._teacher: torch.nn.Module | None = None

    @classmethod
    def check(cls, cfg: DistillConfig, run_cfg: Any) -> None:
        if cfg.enabled and not cfg.teacher:
            raise ValueError("invalid plug-in setting(s): plugins.distill.teacher='' (plugins.distill.enabled needs "
                             "a teacher model; see docs/plugins.md)")

    def extra_loss(self, mb: Any, logits: torch.Tensor, total: torch.Tensor, stats: Stats) -> torch.Tensor:
        d, run = self.cfg, self.ctx.cfg
        teacher = self.teacher(logits.shape[-1])
        temp = run.rollout.temperature if run.rollout.temperature > 0 else 1.0
        with torch.no_grad():
            t_logps = torch.log_softmax(self.ctx.forward.logits(teacher, mb).float() / temp, dim=-1)
            t_top, t_ids = torch.topk(t_logps, min(d.topk, t_logps.shape[-1]), dim=-1)
        mask = mb.response_mask
        kl_mat, s = topk_forward_kl(logits / temp, t_top, t_ids, mask, log_prob_min=d.log_prob_min,
                                    loss_max=d.loss_max)
        kl = aggregate(kl_mat, mask, self.ctx.recipe.loss_agg, norm_len=run.rollout.max_new_tokens)
        total = total + d.coef * kl
        stats.update(s)
        stats["distill/loss"] = float(kl.detach())
        stats["loss/total"] = float(total.detach())
        return total

    def teacher(self, vocab: int) -> torch.nn.Module:
        """The frozen teacher, loaded on first use; its vocabulary must be the policy's."""
        if self._teacher is None:
            from meshrl.models import load_model

            d = self.cfg
            try:
                model, _ = load_model(d.teacher, dtype=self.ctx.cfg.train.dtype, seed=d.teacher_seed)
            except ValueError as e:
                raise ValueError(f"plugins.distill.teacher: {e}") from e
            size = model.get_output_embeddings().weight.shape[0]
            if size != vocab:
                raise ValueError(f"plugins.distill.teacher {d.teacher!r} has a vocabulary of {size} tokens, the "
                                 f"policy {vocab}: top-K distillation needs the same tokenizer")
            device = next(self.ctx.forward.model.parameters()).device
            self._teacher = model.to(device).eval().requires_grad_(False)
        return self._teacher
