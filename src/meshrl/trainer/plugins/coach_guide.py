"""``plugins.coach_guide``: coach-guided exploration, the coach's strategy as the first tokens of the *response*.

Coach Prompting (docs/method.md) conditions a rollout on a strategy prefix in the *prompt*. At test time there is
no coach, and the collapse testbed (experiments/collapse_testbed/results.md) measured why that can fail to keep a
niche strategy: under a prefix whose procedure does not fit, the only reward comes from ignoring the prefix, and
the unconditioned policy's own choice of procedure gets no direct signal. This plug-in moves the coach into
the response:

* **Sampling.** Each Mesh prefix arm (``mesh.m`` coach strategies) is sampled under the *unconditioned* prompt with
  the response forced to start with the strategy's opening, ``task.response_opening(problem, prefix)`` (the
  testbed: the strategy tag ``"t:"``; any other task: the prefix text and a newline, i.e. the model's first line is
  the coach's plan). The model writes the rest within ``rollout.max_new_tokens`` minus the opening's tokens, so a
  guided response is no longer than a free one. Bare groups (``mesh.bare_group``) stay free rollouts.
* **Advantages** over the whole query (``mesh.adv_unit=query`` is required): with per-prefix-group advantages every
  row of a group has the same opening, and the opening's gradient would cancel. Over the query a strategy's opening
  is pushed up exactly when its rollouts beat the query's mean, which is the signal the unconditioned policy's
  choice of strategy lacked.
* **Loss.** The opening tokens were chosen by the coach, not sampled by the policy: they take LUFFY's shaped,
  unclipped off-policy loss ``-A f(pi_theta(y_t))``, ``f(p) = p / (p + gamma)`` (Yan et al. 2025, arXiv 2504.14945,
  eq. 6), or with ``shape=none`` the importance ratio against the coach as a deterministic behaviour policy,
  ``-A pi_theta(y_t)``, or with ``shape=log`` ``-A log pi_theta(y_t)`` (trained as if sampled: biased, but its
  gradient does not vanish when the policy has all but dropped a strategy, where the other two's do). The
  continuation was sampled by the policy given prompt and opening: the recipe's own on-policy loss, its ratio
  against ``pi_old`` on the same context.

This joins Coach Prompting (the strategies come from the coach) with off-policy guidance (LUFFY's shaping of tokens
the policy did not choose); docs/plugins.md, "Coach-guided exploration". The sampler's own log-probs cover the
continuation only, so guided rows are left out of the mismatch diagnostic and of ``plugins.rollout_corr``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import OFF_POLICY_SHAPES, luffy_off_policy_loss
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, Stage, Stats, TokenTerms, register


@dataclass
class CoachGuideConfig:
    enabled: bool = setting(False, help="open each coach arm's response with the coach's strategy (needs mesh or "
                                        "cp_only and mesh.adv_unit=query)")
    gamma: float = setting(0.1, gt=0, help="f(p) = p / (p + gamma) on the forced opening tokens")
    shape: str = setting("p_div_p", choices=OFF_POLICY_SHAPES,
                         help="p_div_p: LUFFY's shaping; none: -A p (the coach as a point-mass behaviour policy); "
                              "log: -A log p (trained as if sampled; recommended, docs/plugins.md)")


@register
class CoachGuide(Plugin):
    name = "coach_guide"
    Config = CoachGuideConfig
    stage = Stage.OFF_POLICY
    order = 2.0
    summary = "coach-guided exploration: the coach's strategy opens the response, off-policy"

    def __init__(self, cfg: CoachGuideConfig, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        self._openings: dict[tuple[Any, int], tuple[list[int], str]] = {}

    def opening(self, problem: Any, strategy: int) -> tuple[list[int], str]:
        """The task's response opening for coach prefix ``strategy`` (cached per problem and prefix); an empty one
        (a plan with nothing to force, e.g. "answer directly") is a free rollout."""
        from meshrl.trainer.openings import opening_ids

        key = (problem.id, strategy)
        if key not in self._openings:
            text = self.ctx.task.response_opening(problem, self.ctx.rollouts.prefixes[problem.id][strategy])
            ids = opening_ids(self.ctx.tokenizer, text, self.ctx.cfg.rollout.max_new_tokens,
                              "plugins.coach_guide") if text else []
            self._openings[key] = (ids, text)
        return self._openings[key]

    @classmethod
    def check(cls, cfg: CoachGuideConfig, run_cfg: Any) -> None:
        if cfg.enabled and run_cfg is not None:
            validate_coach_guide(run_cfg)

    def after_sampling(self, step: int, data: Any, sampler: Any) -> Any:
        data.stats.update(guide_step_stats(self.ctx.task, data))
        return data

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        forced = guided_openings(terms.batch, self.name)
        rows = [forced[j] if j < len(forced) else 0 for j in terms.rows]
        pg_mat, stats = guided_policy_term(self.cfg, rows, terms.logp, terms.adv, terms.mask, pg_mat)
        return pg_mat, agg_mask, stats


def validate_coach_guide(cfg: Any) -> None:
    """Settings that only the whole run config can judge: a coach recipe and one advantage group per query."""
    if not cfg.plugins.coach_guide.enabled:
        return
    if not cfg.mesh_enabled:
        raise ValueError(f"plugins.coach_guide.enabled needs a recipe with a coach (mesh or cp_only); the recipe is "
                         f"{cfg.recipe!r}")
    if cfg.mesh.adv_unit != "query":
        raise ValueError("plugins.coach_guide.enabled needs mesh.adv_unit=query (got "
                         f"{cfg.mesh.adv_unit!r}): inside one prefix group every row starts with the same forced "
                         "opening, so its gradient would cancel")


def guided_openings(data: Any, name: str) -> list[int]:
    """Each row's forced opening length if this plug-in (``name``) forced it, else 0."""
    return [n if o == name else 0 for o, n in zip(data.origin, data.unsampled, strict=True)] or [0] * len(data)


def opening_mask(forced: list[int], like: torch.Tensor) -> torch.Tensor:
    """``[n, T]`` bool: True on the first ``forced[r]`` response tokens of row ``r``."""
    pos = torch.arange(like.shape[1], device=like.device)[None, :]
    return pos < torch.tensor(forced, device=like.device)[:, None]


def guided_policy_term(cfg: CoachGuideConfig, forced: list[int], logp: torch.Tensor, adv: torch.Tensor,
                       mask: torch.Tensor, pg_mat: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The recipe's per-token loss ``pg_mat`` with the forced opening tokens replaced by the shaped off-policy
    loss; ``forced`` is each row's opening length (0 for a free row). Logs ``guide/frac_tokens`` (share of the
    valid tokens that are forced), ``guide/prob_mean`` and ``guide/logp_mean`` (mean pi_theta and log pi_theta of
    the forced tokens: how likely the policy itself is to open with the coach's strategies; with one opening per
    strategy the mean probability of the tags stays near 1/m whatever the policy does, while the mean
    log-probability falls as soon as one strategy is dropped)."""
    opening = opening_mask(forced, logp) & (mask > 0)
    off_mask = opening.to(mask.dtype)
    shaped, s = luffy_off_policy_loss(logp, adv, off_mask, gamma=cfg.gamma, shape=cfg.shape)
    n = float(mask.sum().clamp(min=1))
    stats = {"guide/frac_tokens": float(off_mask.sum()) / n}
    if bool(opening.any()):
        stats["guide/prob_mean"] = s["offpolicy/prob_mean"]
        stats["guide/logp_mean"] = float((logp.detach() * off_mask).sum()) / float(off_mask.sum())
    return torch.where(opening, shaped, pg_mat), stats


def guide_step_stats(task: Any, data: Any) -> dict[str, float]:
    """Per step: guided rows, mean score of guided and of free rows, and the free rows' strategy figures
    (``free/strategy/*``: the unconditioned policy's own choice, which the evaluation measures)."""
    from meshrl.trainer.rollout_step import strategy_figures

    forced = guided_openings(data, CoachGuide.name)
    texts = data.label_texts or data.texts  # a tool-using episode is labelled by its model turns
    guided = [s for s, f in zip(data.scores, forced, strict=True) if f]
    free = [i for i, f in enumerate(forced) if not f]
    out = {"guide/rows": float(len(guided))}
    if guided:
        out["guide/score_guided"] = sum(guided) / len(guided)
    if free:
        out["guide/score_free"] = sum(data.scores[i] for i in free) / len(free)
        out.update(strategy_figures(task, [(texts[i], data.scores[i], data.problems[i]) for i in free],
                                    prefix="free/"))
    return out
