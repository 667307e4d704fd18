"""``plugins.remix``: ReMix, reincarnating mix-policy proximal policy gradient (Liang, Tang, Ma, Liu, Zheng, Hu, Bai,
Hao 2025, "Squeeze the Soaked Sponge: Efficient Off-policy Reinforcement Finetuning for Large Language Model",
arXiv 2507.06892, ICLR 2026).

Three parts, as the paper states them (its method section, read through a paper note: the reference repository
AnitaLeungxx/ReMix-Off-Policy-RFT holds no training code):

1. Mix-policy PPG. Step ``k`` trains on its fresh rollouts (policy ``pi_k``) mixed with rollouts of the last
   ``window`` steps (``pi_{k-i}``, ``i`` uniform in ``1..window``), a share ``off_policy_frac`` of the rows
   historical. Each row's ratio is against its own behaviour policy and the clip is centred on ``pi_k / pi_{k-i}``::

       r = pi_theta / pi_{k-i},   c = pi_k / pi_{k-i}
       L = -min(r A, clip(r, c - eps_low, c + eps_high) A)

   (``c = 1`` on the fresh rows: the recipe's PPO clip). ``A`` is the row's advantage from its own step (group
   relative: fixed once the group is scored). The update-to-data ratio is the run's ``train.ppo_epochs`` x
   ``train.mini_batches`` (the paper's ``m = 2``).
2. KL-Convex constraint, in place of the recipe's KL to the reference::

       beta * [lambda_t KL(pi_theta || pi_base) + (1 - lambda_t) KL(pi_theta || pi_{k-1})]
       lambda_t = max(lambda_max - decay * ceil(max(t - decay_start, 0) / decay_every), lambda_min)

   (the paper's schedule: ``max(1 - 0.1 ceil(max(t - 50, 0) / 10), 0.5)``), each KL the recipe's ``k3`` per-token
   estimator on the sampled tokens, aggregated like the recipe's KL term. ``t`` is the 1-based step.
3. Policy reincarnation: from step ``reincarnate_at`` on, ``pi_base`` is replaced by the policy at that point and
   training is on-policy (no historical rows).

Defaults are the paper's: ``off_policy_frac`` 0.4, ``window`` 2, ``reincarnate_at`` 50 (ReMix-GRPO; 50 or 100 for
ReMix-PPO), the ``lambda`` schedule above. ``beta`` is not in the sources read: the default 1e-3 is the
``grpo_kl`` recipe's. meshrl's choices: the historical rows are added to the step's fresh ones (the fresh batch keeps
``rollout.prompts_per_step``; lower it to keep the training batch's size), drawn as whole advantage groups; a
step's behaviour log-probs are scored at the start of its update. ``pi_base`` and ``pi_{k-1}`` are two frozen copies
of the policy kept in memory; they are not in the checkpoint, so a run with this plug-in cannot be resumed (refused).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import aggregate, kl_penalty
from meshrl.algos.divergences import LOG_RATIO_CLAMP
from meshrl.settings import setting
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.loss import pad_rows
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, TokenTerms, register


@dataclass
class RemixConfig:
    enabled: bool = setting(False, help="ReMix: mix-policy PPG over recent steps' rollouts, KL-Convex constraint, "
                                        "policy reincarnation")
    off_policy_frac: float = setting(0.4, ge=0, lt=1, help="share of the training rows taken from earlier steps")
    window: int = setting(2, ge=1, help="earlier steps whose rollouts may be reused")
    beta: float = setting(1e-3, ge=0, help="weight of the KL-Convex term")
    lambda_max: float = setting(1.0, ge=0, le=1, help="lambda (weight of KL to pi_base) before the decay starts")
    lambda_min: float = setting(0.5, ge=0, le=1, help="lambda's floor")
    decay: float = setting(0.1, ge=0, help="lambda's drop per decay_every steps")
    decay_start: int = setting(50, ge=0, help="step after which lambda decays")
    decay_every: int = setting(10, ge=1, help="steps per lambda drop")
    reincarnate_at: int = setting(50, ge=0, help="from this step on: pi_base = the current policy, on-policy only "
                                                 "(0 = never)")


@register
class Remix(Plugin):
    name = "remix"
    episodes_ok = False  # reads each response as one sampled stream; an episode interleaves tool output
    Config = RemixConfig
    stage = Stage.BASE_LOSS
    order = 2.0
    excludes = ("replay", "luffy", "kl_cov", "m2po")  # each also sets the batch's or the ratio's policy
    summary = "ReMix: mix-policy PPG, KL-Convex constraint, policy reincarnation (Liang et al. 2025)"

    def __init__(self, cfg: RemixConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        model = ctx.forward.model
        self.base = copy.deepcopy(model).eval().requires_grad_(False)  # pi_base (reset at reincarnation)
        self.prev = copy.deepcopy(model).eval().requires_grad_(False)  # pi_{k-1}
        self.history: list[tuple[Any, list[torch.Tensor], int]] = []  # (fresh rows, their behaviour logps, step)
        self.step = 0
        self.n_fresh = 0
        self.hist_logps: list[torch.Tensor] = []  # behaviour log-probs of this step's historical rows
        self.start: list[torch.Tensor] | None = None  # pi_k on every row (the clip centre's numerator)
        self.anchors: tuple[list[torch.Tensor], list[torch.Tensor], float] | None = None
        self.rows: list[int] = []

    @classmethod
    def check(cls, cfg: RemixConfig, run_cfg: Any) -> None:
        if cfg.lambda_min > cfg.lambda_max:
            raise ValueError(f"plugins.remix.lambda_min={cfg.lambda_min} exceeds "
                             f"plugins.remix.lambda_max={cfg.lambda_max}")
        if not cfg.enabled or run_cfg is None:
            return
        rec = run_cfg.resolved_recipe()
        if rec.policy_loss != "ppo_clip" or rec.clip_dual is not None:
            raise ValueError(f"plugins.remix needs the plain ppo_clip policy loss (algo.policy_loss is "
                             f"{rec.policy_loss!r}, clip_dual {rec.clip_dual}): mix-policy PPG re-centres its clip")
        if rec.kl_coef > 0 or rec.js_coef > 0:
            raise ValueError("plugins.remix: the KL-Convex term replaces the recipe's KL/JS to the reference; use a "
                             "recipe with algo.kl_coef=0 and algo.js_coef=0")

    def lam(self, t: int) -> float:
        """lambda_t of the KL-Convex term at the 1-based step ``t``."""
        c = self.cfg
        drops = math.ceil(max(t - c.decay_start, 0) / c.decay_every)
        return max(c.lambda_max - c.decay * drops, c.lambda_min)

    def mixing(self) -> bool:
        return self.cfg.reincarnate_at == 0 or self.step < self.cfg.reincarnate_at

    # ---- sampling
    def after_sampling(self, step: int, data: Any, sampler: Any) -> Any:
        """The fresh rows, then whole groups of the stored steps' rows up to ``off_policy_frac`` of the total."""
        self.step, self.n_fresh, self.hist_logps = step, len(data), []
        if self.cfg.reincarnate_at and step == self.cfg.reincarnate_at:
            self.base.load_state_dict(self.ctx.forward.model.state_dict())  # pi_base <- pi_T
            self.history = []
        data.stats.update({"remix/hist_rows": 0.0, "remix/age_mean": 0.0,
                           "remix/reincarnated": float(not self.mixing())})
        if not self.mixing() or not self.history or not len(data) or self.cfg.off_policy_frac == 0:
            return data
        p = self.cfg.off_policy_frac
        want = round(p / (1 - p) * len(data))
        gen = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + step)
        pools = [list(dict.fromkeys(h.group_ids)) for h, _, _ in self.history]
        mixed, ages = data.select(list(range(len(data)))), []
        while len(mixed) - len(data) < want and any(pools):
            k = int(torch.randint(len(self.history), (1,), generator=gen))  # i ~ uniform over the window
            if not pools[k]:
                continue
            group = pools[k].pop(int(torch.randint(len(pools[k]), (1,), generator=gen)))
            hist, logps, born = self.history[k]
            rows = [i for i, g in enumerate(hist.group_ids) if g == group]
            _append(mixed, hist, rows)
            self.hist_logps.extend(logps[i] for i in rows)
            ages.extend([step - born] * len(rows))
        mixed.stats = {**data.stats, "remix/hist_rows": float(len(ages)),
                       "remix/age_mean": sum(ages) / len(ages) if ages else 0.0}
        mixed.seen = data.seen
        return mixed

    def behaviour_logps(self, data: Any, old_logps: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """Fresh rows against ``pi_k``, historical rows against the policy that sampled them; the fresh rows and
        their ``pi_k`` log-probs are stored for the next ``window`` steps."""
        self.start = None
        if not len(data) or not self.mixing() or self.cfg.off_policy_frac == 0:
            return old_logps  # on-policy: nothing to store, no extra forward
        # One no-grad forward when the update has none (one optimiser step per batch): pi_k on every row, for the
        # clip centres and for the history (after this step's update pi_k is gone).
        start = old_logps if old_logps is not None else self.ctx.forward.logps(self.ctx.forward.model, data)
        self.start = start
        fresh = list(range(self.n_fresh))
        self.history = [*self.history, (data.select(fresh), start[: self.n_fresh], self.step)][-self.cfg.window:]
        if not self.hist_logps:
            return old_logps
        return [*start[: self.n_fresh], *self.hist_logps]

    # ---- the update
    def begin_update(self, data: Any, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> Stats:
        """Score the rows under ``pi_base`` and ``pi_{k-1}`` (the KL-Convex anchors), then keep ``pi_k`` as the
        next step's ``pi_{k-1}``."""
        if not len(data):
            return {}
        forward, lam = self.ctx.forward, self.lam(self.step + 1)
        base, prev = forward.logps(self.base, data), forward.logps(self.prev, data)
        self.anchors = (base, prev, lam)
        self.prev.load_state_dict(forward.model.state_dict())
        return {"remix/lambda": lam}

    def base_loss(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats] | None:
        """Mix-policy PPG on a batch with historical rows; the recipe's PPO clip otherwise (the same on fresh rows)."""
        if not self.hist_logps:
            return None
        t = terms
        start = pad_rows([self.start[j] for j in t.rows], t.logp)
        mat, stats = mix_ppg_loss(t.logp, t.old, start, t.adv, t.mask, clip_low=t.loss_cfg["clip_low"],
                                  clip_high=t.loss_cfg["clip_high"])
        return mat, stats

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        self.rows = terms.rows  # the micro-batch's rows, for extra_loss (called next, on the same micro-batch)
        return pg_mat, agg_mask, {}

    def extra_loss(self, mb: Any, logits: torch.Tensor, total: torch.Tensor, stats: Stats) -> torch.Tensor:
        """``beta * aggregate(lambda k3(pi_theta, pi_base) + (1 - lambda) k3(pi_theta, pi_{k-1}))``."""
        if self.anchors is None or self.cfg.beta == 0:
            return total
        base, prev, lam = self.anchors
        run = self.ctx.cfg
        logp = token_logprobs(logits, mb.response_ids, run.rollout.temperature)
        kl_base = kl_penalty(logp, pad_rows([base[j] for j in self.rows], logp), "k3")
        kl_prev = kl_penalty(logp, pad_rows([prev[j] for j in self.rows], logp), "k3")
        mask = mb.response_mask.to(logp.device)
        klc = aggregate(lam * kl_base + (1 - lam) * kl_prev, mask, self.ctx.recipe.loss_agg,
                        norm_len=run.rollout.max_new_tokens)
        total = total + self.cfg.beta * klc
        stats["remix/klc"] = float(klc.detach())
        stats["loss/total"] = float(total.detach())
        return total

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        return {"step": self.step + 1}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state and state.get("step", 0) > 0:
            raise ValueError("plugins.remix: a run cannot be resumed (pi_base, pi_{k-1} and the reused rollouts are "
                             "not in the checkpoint); start it again")


def mix_ppg_loss(logp: torch.Tensor, behaviour: torch.Tensor, start: torch.Tensor, adv: torch.Tensor,
                 mask: torch.Tensor, *, clip_low: float, clip_high: float) -> tuple[torch.Tensor, Stats]:
    """``-min(r A, clip(r, c - eps_low, c + eps_high) A)`` per token, ``r = pi_theta / pi_b``, ``c = pi_k / pi_b``
    (all ``[n, T]`` but ``adv``, ``[n]`` or ``[n, T]``); ``mask`` only weighs the metrics.

    Both log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` (20) before ``exp``, as the recipe's PPO
    clip does (:func:`meshrl.algos.ppo_clip_loss`, after verl's ``compute_policy_loss_vanilla`` in
    ``verl/trainer/ppo/core_algos.py``, which clamps ``negative_approx_kl`` to ``[-20, 20]``): a token that far off
    its behaviour policy gives at most ``e^20`` (about 4.9e8) with gradient 0, never ``inf``/NaN. Inside the clamp
    nothing changes, bit for bit."""
    a = adv[:, None] if adv.dim() == 1 else adv
    ratio = torch.exp((logp - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    centre = torch.exp((start - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    clipped = torch.maximum(torch.minimum(ratio, centre + clip_high), centre - clip_low)
    mat = torch.maximum(-a * ratio, -a * clipped)  # masked by the aggregation, as the recipe's losses
    n = mask.sum().clamp(min=1)
    off = (centre - 1).abs() > 0
    return mat, {"remix/clip_frac": float(((-a * clipped > -a * ratio) & (mask > 0)).sum() / n),
                 "remix/centre_mean": float((centre * mask).sum() / n),
                 "remix/off_tokens": float((off & (mask > 0)).sum() / n)}


def _append(out: Any, data: Any, rows: list[int]) -> None:
    """Rows of ``data`` appended to ``out``, with their rewards and advantages."""
    out.extend(data, rows)
    idx = torch.tensor(rows, dtype=torch.long)
    for name in ("rewards", "advantages"):
        t = getattr(data, name)
        if t is not None:
            cur = getattr(out, name)
            setattr(out, name, t[idx] if cur is None else torch.cat([cur, t[idx]]))
