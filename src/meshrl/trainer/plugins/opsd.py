"""``plugins.opsd``: on-policy self-distillation with privileged context, added to the recipe's loss.

Source: Zhao, Xie, Liu, Huang, Pang, Chen, Grover 2026, "Self-Distilled Reasoner: On-Policy Self-Distillation for
Large Language Models", arXiv 2601.18734, and its reference code (github.com/siyan-zhao/OPSD: ``opsd_trainer.py``
``compute_loss`` / ``generalized_jsd_loss``, ``data_collator.py``, ``scripts/run_opsd.sh``). The teacher is the
*same* model shown privileged context; the student is the policy on the prompt it sampled under; both score the
student's own rollout ``y`` token by token, and the student is pulled toward the teacher:

    L_t = D( p_T(. | c, x, y_<t) , p_S(. | x, y_<t) ),    p = softmax(logits / T_rollout)

with the gradient through the student only (the teacher is scored without a graph). ``loss``:

- ``jsd`` (the reference code's default, ``--beta 0.5``): the generalised Jensen-Shannon divergence of GKD at
  beta = 1/2 over the whole vocabulary, ``1/2 KL(p_T || m) + 1/2 KL(p_S || m)``, ``m = (p_T + p_S)/2``, which is
  :func:`meshrl.algos.js_divergence`;
- ``forward_kl_topk``: ``plugins.distill``'s top-K forward KL with its per-token clamps
  (:func:`meshrl.algos.topk_forward_kl`), for vocabularies where a full-vocabulary divergence is too large (the
  reference code's ``--top_k_loss`` instead renormalises both distributions over the teacher's top-K; that form
  is not offered here).

``coef`` times the recipe's aggregation of ``L`` is added to the micro-batch's loss, as ``plugins.distill``'s
term is. ``teacher``: ``initial`` is the frozen start policy (the run's reference; the reference code's
recommended ``--fixed_teacher``, used in all its scripts), ``current`` the policy being trained (its default).

``context`` (the teacher's prompt, built from the task's own problems):

- ``reference``: the problem's reference answer before its prompt, with the reference code's transition sentence
  ("Here is a reference solution ..."; ``data_collator.py``). A problem without an answer gives no teacher; its
  rows are left out of the term and counted (``opsd/no_context_frac``, their share of the step's rows);
- ``other``: another problem of the training set (the next one in the task's order) with its answer, then this
  problem: the reading list's variant, which keeps most of the gain without this problem's solution. The choice
  of the other problem is meshrl's.

The teacher prompt is the task's user message with the context in front, through the same chat encoding as the
rollouts (:func:`meshrl.models.encode_prompt`); a coach prefix the rollout was sampled under is not given to the
teacher. Metrics: ``opsd/loss`` (the term before ``coef``), ``opsd/teacher_logp`` and ``opsd/student_logp`` (mean
log-prob of the sampled tokens under each), ``opsd/context_tokens`` (mean teacher prompt length),
``opsd/no_context_frac``; with ``forward_kl_topk`` also ``opsd/teacher_mass``, ``opsd/student_mass`` and
``opsd/overlap_ratio`` (as ``plugins.distill``'s).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import aggregate, js_divergence, topk_forward_kl
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, TokenTerms, register

log = logging.getLogger("meshrl")

CONTEXTS = ("reference", "other")
TEACHERS = ("initial", "current")
LOSSES = ("jsd", "forward_kl_topk")
# The reference code's transition sentence (data_collator.py). Its teacher prompt is the problem, the reference
# solution, this sentence and an instruction; meshrl keeps the student's own formatted prompt whole (its chat
# template, its answer instruction) and puts the privileged context before it: the answer, this sentence, then the
# student's prompt. The order differs from the reference; the teacher sees the same information.
REFERENCE_INTRO = "Here is a reference solution to this problem:\n"
TRANSITION = ("After understanding the reference solution and the rationale behind each step, now articulate your "
              "own step-by-step reasoning that derives the same final answer to the problem below:\n")
OTHER_INTRO = "Here is an example problem and its solution:\n"
OTHER_TRANSITION = "Now solve the problem below:\n"


@dataclass
class OpsdConfig:
    enabled: bool = setting(False, help="add an on-policy self-distillation term: the same model shown privileged "
                                        "context is the teacher of its own rollouts")
    context: str = setting("reference", choices=CONTEXTS,
                           help="the teacher's privileged context: reference (this problem's answer) or other "
                                "(another training problem with its answer)")
    teacher: str = setting("initial", choices=TEACHERS,
                           help="initial: the frozen start policy (the reference code's --fixed_teacher); "
                                "current: the policy being trained, scored without a graph")
    loss: str = setting("jsd", choices=LOSSES,
                        help="jsd: Jensen-Shannon at beta 1/2 over the whole vocabulary (the paper's); "
                             "forward_kl_topk: plugins.distill's top-K forward KL with its clamps")
    coef: float = setting(1.0, gt=0, help="weight of the self-distillation term in the loss")
    topk: int = setting(128, ge=1, help="forward_kl_topk: the teacher's top-K tokens per position")
    log_prob_min: float = setting(-10.0, help="forward_kl_topk: both log-probs clamped from below")
    loss_max: float = setting(10.0, gt=0, help="forward_kl_topk: per-token loss clamped from above")


@register
class Opsd(Plugin):
    """The teacher's prompts per problem (cached), its forward per micro-batch, the divergence (module docstring)."""

    name = "opsd"
    episodes_ok = False  # reads each response as one sampled stream; an episode interleaves tool output
    Config = OpsdConfig
    stage = Stage.EXTRA_LOSS
    order = 1.5
    token_level = False  # a term of its own: fine with the sequence-level losses
    needs_reference = True  # teacher=initial scores with the frozen start policy (see uses_reference)
    summary = "on-policy self-distillation: the same model with privileged context as the teacher"

    def __init__(self, cfg: OpsdConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self._prompts: dict[str, list[int] | None] = {}
        self._rows: list[int] | None = None
        self._batch: Any = None
        if cfg.context == "other" and len({p.id for p in ctx.problems}) < 2:
            raise ValueError("plugins.opsd.context='other' needs at least two training problems; the task has "
                             f"{len(ctx.problems)}")

    @classmethod
    def uses_reference(cls, cfg: OpsdConfig) -> bool:
        """Only the initial teacher is the frozen reference; the current one needs no copy of the model."""
        return cfg.teacher == "initial"

    def shape_advantages(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats]:
        """Leaves the advantages alone; remembers which step rows the micro-batch holds, since the loss hook that
        follows in the same micro-batch (:meth:`extra_loss`) is given the collated batch only."""
        self._rows, self._batch = list(terms.rows), terms.batch
        return terms.adv, {}

    def extra_loss(self, mb: Any, logits: torch.Tensor, total: torch.Tensor, stats: Stats) -> torch.Tensor:
        rows, data = self._rows, self._batch
        if rows is None or len(rows) != logits.shape[0]:
            raise RuntimeError("plugins.opsd: the micro-batch's rows were not seen before its loss")
        self._rows = self._batch = None
        prompts = [self.teacher_prompt(data.problems[j]) for j in rows]
        has = torch.tensor([p is not None for p in prompts], dtype=mb.response_mask.dtype,
                           device=mb.response_mask.device)
        stats["opsd/no_context_frac"] = (len(rows) - float(has.sum())) / len(rows)  # row-weighted over micro-batches
        if not bool(has.any()):
            stats["opsd/loss"] = 0.0
            return total
        mask = mb.response_mask * has[:, None]
        t_logits = self.teacher_logits(mb, [p if p is not None else [] for p in prompts], rows, data)
        run = self.ctx.cfg
        temp = run.rollout.temperature if run.rollout.temperature > 0 else 1.0
        mat, extra = divergence(self.cfg, logits / temp, t_logits / temp, mask)
        term = aggregate(mat, mask, self.ctx.recipe.loss_agg, norm_len=run.rollout.max_new_tokens)
        total = total + self.cfg.coef * term
        stats.update(extra)
        n = float(mask.sum().clamp(min=1))
        stats["opsd/loss"] = float(term.detach())
        stats["opsd/context_tokens"] = sum(len(p) for p in prompts if p is not None) / float(has.sum())
        with torch.no_grad():
            ids = mb.response_ids.unsqueeze(-1)
            s_lp = torch.log_softmax(logits.detach().float() / temp, -1).gather(-1, ids).squeeze(-1)
            t_lp = torch.log_softmax(t_logits.float() / temp, -1).gather(-1, ids).squeeze(-1)
        stats["opsd/teacher_logp"] = float((t_lp * mask).sum()) / n
        stats["opsd/student_logp"] = float((s_lp * mask).sum()) / n
        stats["loss/total"] = float(total.detach())
        return total

    @torch.no_grad()
    def teacher_logits(self, mb: Any, prompts: list[list[int]], rows: list[int], data: Any) -> torch.Tensor:
        """The teacher's response logits ``[n, T, V]``: each row's response after its privileged prompt."""
        forward = self.ctx.forward
        tmb = forward.collate(prompts, [data.response_ids[j] for j in rows])
        if tuple(tmb.response_ids.shape) != tuple(mb.response_ids.shape):
            raise RuntimeError("plugins.opsd: the teacher's responses do not line up with the micro-batch's")
        if self.cfg.teacher == "initial":
            return forward.reference_logits(tmb).float()
        return forward.logits(forward.model, tmb).float()

    def teacher_prompt(self, problem: Any) -> list[int] | None:
        """Token ids of the teacher's prompt for ``problem`` (cached), None when it has no context to give."""
        if problem.id not in self._prompts:
            text = self.teacher_text(problem)
            if text is None:
                log.warning("plugins.opsd: problem %r has no reference answer; its rows get no teacher (counted in "
                            "opsd/no_context_frac)", problem.id)
                self._prompts[problem.id] = None
            else:
                from meshrl.models import encode_prompt

                self._prompts[problem.id] = encode_prompt(self.ctx.tokenizer, text)
        return self._prompts[problem.id]

    def teacher_text(self, problem: Any) -> str | None:
        """The teacher's user message: the privileged context, then the task's own prompt for ``problem``."""
        question = self.ctx.task.format_prompt(problem)
        if self.cfg.context == "reference":
            if not str(problem.answer).strip():
                return None
            return f"{REFERENCE_INTRO}{problem.answer}\n\n{TRANSITION}{question}"
        other = other_problem(self.ctx.problems, problem)
        return (f"{OTHER_INTRO}{self.ctx.task.format_prompt(other)}\n{other.answer}\n\n"
                f"{OTHER_TRANSITION}{question}")


def other_problem(problems: list[Any], problem: Any) -> Any:
    """The first problem after ``problem`` in ``problems`` (cyclically) with a different id."""
    ids = [p.id for p in problems]
    start = ids.index(problem.id) if problem.id in ids else -1
    for k in range(1, len(problems) + 1):
        cand = problems[(start + k) % len(problems)]
        if cand.id != problem.id:
            return cand
    raise ValueError("plugins.opsd.context='other' needs at least two training problems")


def divergence(cfg: OpsdConfig, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor
               ) -> tuple[torch.Tensor, Stats]:
    """Per-token ``[n, T]`` loss (0 where masked) of tempered student and teacher logits, and its metrics."""
    if cfg.loss == "jsd":
        return js_divergence(student, teacher.detach()) * mask, {}
    t_logps = torch.log_softmax(teacher.detach().float(), dim=-1)
    t_top, t_ids = torch.topk(t_logps, min(cfg.topk, t_logps.shape[-1]), dim=-1)
    mat, s = topk_forward_kl(student, t_top, t_ids, mask, log_prob_min=cfg.log_prob_min, loss_max=cfg.loss_max)
    return mat, {k.replace("distill/", "opsd/"): v for k, v in s.items()}
