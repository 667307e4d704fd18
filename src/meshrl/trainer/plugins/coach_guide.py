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

import dataclasses
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

    @classmethod
    def check(cls, cfg: CoachGuideConfig, run_cfg: Any) -> None:
        if cfg.enabled and run_cfg is not None:
            validate_coach_guide(run_cfg)

    def after_sampling(self, step: int, data: Any, sampler: Any) -> Any:
        data.stats.update(guide_step_stats(self.ctx.task, data))
        return data

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        forced = terms.batch.forced_tokens
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


def opening_ids(tokenizer: Any, text: str, max_new_tokens: int) -> list[int]:
    """Token ids of an opening (encoded on its own, as ``encode_prompt`` appends an assistant prefix); it must
    leave room for at least one generated token."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError(f"plugins.coach_guide: the response opening {text!r} encodes to no tokens")
    if len(ids) >= max_new_tokens:
        raise ValueError(f"plugins.coach_guide: the response opening {text!r} is {len(ids)} tokens, not less than "
                         f"rollout.max_new_tokens={max_new_tokens}")
    return ids


def generate_guided(backend: Any, prompts: list[list[int]], openings: list[tuple[list[int], str]], params: Any, *,
                    seed: int, features: bool = False) -> list[dict[str, Any]]:
    """Sample ``params.n`` responses per prompt, each forced to start with its ``openings`` entry, ``(token ids,
    text)`` (``([], "")``: a free rollout).

    Prompts are sampled in one call per opening length (a guided row gets ``max_new_tokens - len(opening)`` new
    tokens); the free call keeps ``seed``, so without openings this samples exactly what one plain call does.
    Returns one record per sample in prompt-major order (``prompt_index``, ``prompt_ids`` without the opening,
    ``response_ids`` and ``text`` with it, ``truncated``, ``logps``: the sampler's log-probs, None for guided
    rows, whose opening the sampler did not choose, ``forced``: the opening's token count, and ``features``: the
    sampler's MEI features when ``features`` asks for them, None for guided rows, whose opening they would miss).
    """
    by_len: dict[int, list[int]] = {}
    for i, (op, _) in enumerate(openings):
        by_len.setdefault(len(op), []).append(i)
    rows: dict[int, list[dict[str, Any]]] = {}
    for length, members in sorted(by_len.items()):
        p = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - length)
        out = backend.generate([prompts[i] + openings[i][0] for i in members], p, seed=seed + 7919 * length,
                               **({"features": True} if features else {}))
        for r, ai in enumerate(out.prompt_index):
            i = members[ai]
            op, op_text = openings[i]
            logps = None if out.engine_logprobs is None or op else list(out.engine_logprobs[r])
            feats = None if out.engine_features is None or op else out.engine_features[r]
            rows.setdefault(i, []).append({
                "prompt_index": i, "prompt_ids": list(out.prompt_ids[r][: len(out.prompt_ids[r]) - len(op)]),
                "response_ids": op + list(out.response_ids[r]), "text": op_text + out.texts[r],
                "truncated": bool(out.truncated[r]), "logps": logps, "forced": len(op), "features": feats})
    return [rec for i in range(len(prompts)) for rec in rows.get(i, [])]


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

    forced = list(data.forced_tokens) or [0] * len(data)
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
