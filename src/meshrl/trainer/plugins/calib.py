"""``plugins.calib``: CalibRL's expert-calibrated term (Huang, Jia, Sun, Li, Han, "Controllable Exploration in
Hybrid-Policy RLVR for Multi-Modal Reasoning", ICLR 2026, arXiv 2602.20197; reference code
github.com/zhh6425/CalibRL, ``src/core_algos.py``, ``compute_mix_policy_loss`` with ``mix_policy_loss=
"expert-guided"``, and ``src/dp_actor.py``).

The formula implemented is the reference code's (the paper's equations could not be read here; its abstract
describes the same two mechanisms). For a rollout ``o_i`` of a group whose problem has an expert trace ``e``,
at each response position ``t``::

    g_{i,t} = |A_{i,t}| * LeakyReLU_s( -(2 c_i - 1) * (log pi_theta(o_{i,t}) - sg[log pi_theta(e_t)]) )
    loss    = recipe's policy loss + coef * agg(g)

- ``c_i``: the rollout passed (``meshrl.runs.correct.is_correct`` of its task score; the reference code:
  reward > 0.1, the same split for 0/1 rewards). A correct rollout is pushed up, a wrong one down.
- ``log pi_theta(e_t)``: the expert's ``t``-th token log-prob under the policy at the start of the update (the
  reference's ``old_log_prob`` of the expert row), detached: the expert acts only as a moving threshold.
- The asymmetric activation: full slope on the corrective side (a correct rollout less likely than the expert,
  a wrong one more likely), slope ``negative_slope`` (0.5) on the over-confident side, so those updates are
  damped but keep their direction.
- ``|A|``: the group-rarity weight. With the reference's Dr.GRPO advantages ``r - mean(r)`` of 0/1 rewards,
  ``|A| = 1 - p`` for a correct and ``p`` for a wrong rollout of a group with pass rate ``p``: the rarer the
  outcome in its group, the larger the update. Here it is whatever the recipe's advantages are (GRPO's are
  divided by the group's std as well; ``algo.adv_scale=none`` gives the reference's form).
- ``coef``: 0.1, the reference's weight (``policy_loss + 0.1 * guided_loss``); ``agg`` is the recipe's
  aggregation over the same mask as the policy loss.

The expert trace is never trained on and is not part of the group (the reference keeps it out of the group's
reward mean and of the policy loss): it is scored once per update under each row's prompt and compared position
by position, as the reference does. Positions past the expert's length have no expert token: they take no term
(the reference compares them with the log-prob of a pad token) and are counted (``calib/covered_frac``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from meshrl.algos import aggregate
from meshrl.settings import setting
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, TokenTerms, register


@dataclass
class CalibConfig:
    enabled: bool = setting(False, help="add CalibRL's expert-calibrated term (needs expert traces)")
    traces: str = setting("", help='JSONL of expert traces, one {"id": problem id, "completion": text} per line')
    coef: float = setting(0.1, gt=0, help="weight of the term (the reference code's 0.1)")
    negative_slope: float = setting(0.5, ge=0, le=1, help="LeakyReLU slope on the over-confident side (0.5)")


@register
class Calib(Plugin):
    name = "calib"
    episodes_ok = False  # reads each response as one sampled stream; an episode interleaves tool output
    Config = CalibConfig
    stage = Stage.EXTRA_LOSS
    order = 0.5
    summary = "CalibRL: |A|-weighted LeakyReLU term against an expert trace's log-probs (Huang et al. 2026)"

    def __init__(self, cfg: CalibConfig, ctx: PluginContext) -> None:
        # imported here, not at module level: importing luffy first would reorder the registry (and the docs)
        from meshrl.trainer.plugins.luffy import load_traces

        super().__init__(cfg, ctx)
        self.traces = load_traces(Path(cfg.traces))
        self.expert: dict[int, torch.Tensor] = {}  # row -> the expert's per-position log-probs (detached)

    @classmethod
    def check(cls, cfg: CalibConfig, run_cfg: Any) -> None:
        if cfg.enabled and not Path(cfg.traces).is_file():
            raise ValueError(f"plugins.calib.traces: no such file {cfg.traces!r} (a JSONL of "
                             '{"id": problem id, "completion": text} rows)')

    def begin_update(self, data: Any, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> Stats:
        """Score each group's expert trace under the start policy, once per distinct prompt of the group."""
        from meshrl.trainer.plugins.luffy import trace_ids

        self.expert = {}
        if not len(data):
            return {}
        max_len = self.ctx.cfg.rollout.max_new_tokens  # a rollout never reaches past it: nor does the comparison
        wanted: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
        groups: dict[Any, list[int]] = {}
        for i, g in enumerate(data.group_ids):
            groups.setdefault(g, []).append(i)
        missing = 0
        for rows in groups.values():
            texts = self.traces.get(str(data.problems[rows[0]].id))
            if not texts:
                missing += 1
                continue
            text = texts[data.query_ids[rows[0]] % len(texts)]
            ids = tuple(trace_ids(self.ctx.tokenizer, text)[:max_len])
            for i in rows:
                wanted.setdefault((tuple(data.prompt_ids[i]), ids), []).append(i)
        logps = self._score(list(wanted))
        for key, lp in zip(wanted, logps, strict=True):
            for i in wanted[key]:
                self.expert[i] = lp
        scored = list(logps)
        return {"calib/groups_without_trace": float(missing),
                "calib/expert_logp_mean": (float(torch.cat(scored).mean()) if scored else 0.0)}

    @torch.no_grad()
    def _score(self, pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[torch.Tensor]:
        fwd, out = self.ctx.forward, []
        size = max(1, fwd.micro_batch_size)
        for k in range(0, len(pairs), size):
            chunk = pairs[k : k + size]
            mb = fwd.collate([list(p) for p, _ in chunk], [list(e) for _, e in chunk])
            lp = token_logprobs(fwd.logits(fwd.model, mb), mb.response_ids, fwd.temperature)
            out.extend(lp[j, : len(e)].float().cpu() for j, (_, e) in enumerate(chunk))
        return out

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        from meshrl.runs.correct import is_correct

        t = terms
        expert, covered = expert_matrix([self.expert.get(j) for j in t.rows], t.logp)
        covered = covered * t.mask
        passed = torch.tensor([is_correct(t.batch.scores[j]) for j in t.rows], dtype=t.logp.dtype,
                              device=t.logp.device)
        g, above = calib_term(t.logp, expert, t.adv, passed, negative_slope=self.cfg.negative_slope)
        g = g * covered
        run = self.ctx.cfg
        term = aggregate(g, agg_mask, self.ctx.recipe.loss_agg, norm_len=run.rollout.max_new_tokens)
        n_valid = float(t.mask.sum().clamp(min=1))
        n_cov = float(covered.sum())
        stats = {"calib/term": float(self.cfg.coef * term.detach()), "calib/covered_frac": n_cov / n_valid,
                 "calib/above_frac": float((above * covered).sum()) / max(n_cov, 1.0)}
        return pg_mat + self.cfg.coef * g, agg_mask, stats


def expert_matrix(rows: list[torch.Tensor | None], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert log-probs [n, T], covered [n, T])``: row ``i``'s expert log-prob at each position it has one
    (0 elsewhere) and a 0/1 mask of those positions; a row without an expert is all uncovered."""
    expert, covered = torch.zeros_like(like.detach()), torch.zeros_like(like.detach())
    width = like.shape[1]
    for i, e in enumerate(rows):
        if e is not None and e.numel():
            n = min(width, e.shape[0])
            expert[i, :n] = e[:n].to(like.device, like.dtype)
            covered[i, :n] = 1.0
    return expert, covered


def calib_term(logp: torch.Tensor, expert: torch.Tensor, adv: torch.Tensor, passed: torch.Tensor, *,
               negative_slope: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``|A| * LeakyReLU(-(2 c - 1) (log pi - sg[log pi_expert]))`` (``[n, T]``, with the graph of
    ``logp``) and the 0/1 mask of tokens on the full-slope (corrective) side. ``adv``: ``[n]`` or ``[n, T]``;
    ``passed``: ``[n]`` 0/1."""
    sign = (2.0 * passed - 1.0)[:, None]
    x = -sign * (logp - expert.detach())
    weight = adv.detach().abs()
    weight = weight[:, None] if weight.dim() == 1 else weight
    return weight * F.leaky_relu(x, negative_slope=negative_slope), (x.detach() > 0).to(logp.dtype)
