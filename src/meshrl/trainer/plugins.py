"""Plug-ins around the recipes' policy term, selected by the ``plugins.*`` config keys (docs/plugins.md).

Each one changes how the per-token policy loss of a micro-batch is built, on top of any recipe (the Mesh
recipes included, whose balancing term is separate):

- ``plugins.entropy_adv``: advantages shaped by the token entropy (Cheng et al. 2025);
- ``plugins.clip_cov`` / ``plugins.kl_cov``: covariance-based token selection (Cui et al. 2025);
- ``plugins.fork``: policy gradient on the high-entropy "forking" tokens only (Wang et al. 2025);
- ``plugins.m2po``: second-moment mask against the behaviour policy (Zheng et al. 2025);
- ``plugins.luffy``: off-policy traces from a JSONL mixed into each group, shaped loss on them (Yan et al.
  2025);
- ``plugins.coach_guide``: the coach's strategy as the first, off-policy tokens of the response under the
  unconditioned prompt, LUFFY-shaped (coach-guided exploration, :mod:`meshrl.trainer.coach_guide`);
- ``plugins.distill``: a top-K forward-KL term to a teacher model on the rollouts (on-policy distillation);
- ``plugins.dpo``: a DPO term on (correct, wrong) pairs of each group's own rollouts against the frozen
  reference (Rafailov et al. 2023; :mod:`meshrl.trainer.dpo_pairs`);
- ``plugins.replay``: each batch of rollouts trained on at ``1 + reuse_steps`` consecutive steps, against the
  log-probs of the policy that sampled it (the stale-rollout setting M2PO is made for);
- ``plugins.rollout_corr``: the policy loss weighted by ``pi_old_train / pi_rollout`` against the sampler's own
  log-probs, truncated or masked, with k1/k2/k3 rejection (Yao et al. 2025; :mod:`meshrl.trainer.rollout_corr`,
  which also holds the per-step ``mismatch/*`` diagnostic every run logs);
- ``plugins.prompt_filter``: problems whose recent groups were all correct or all wrong are skipped before
  sampling, and readmitted later (rollout-based prompt filtering, RIF-RFT).

The selections use statistics of the whole micro-batch (covariance means, an entropy quantile, a moment
over tokens), so a micro-batch must not be split into parts: with any plug-in on, the trainer runs the
update in one process and without the zero-advantage shortcut (``TrainPlugins.changes_loss``). The
formulas live in :mod:`meshrl.algos.entropy_control` and :mod:`meshrl.algos.offpolicy`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshrl.algos import (
    OFF_POLICY_SHAPES,
    aggregate,
    clip_cov_selection,
    entropy_advantage,
    group_advantages,
    kl_cov_loss,
    kl_cov_penalty,
    kl_cov_selection,
    luffy_off_policy_loss,
    m2po_mask,
    policy_loss,
    token_mask,
    topk_forward_kl,
)
from meshrl.algos.entropy_control import _clipped_tokens
from meshrl.trainer.coach_guide import CoachGuideConfig, coach_guide_checks, guide_step_stats, guided_policy_term
from meshrl.trainer.dpo_pairs import DpoConfig, DpoTerm, dpo_checks
from meshrl.trainer.prompt_filter import FilteredProblems, PromptFilterConfig
from meshrl.trainer.rollout_corr import (
    MismatchMonitor,
    RolloutCorrConfig,
    rollout_corr_checks,
    rollout_correction,
    rows_tensor,
)

SEQUENCE_LEVEL_LOSSES = ("gspo",)  # one ratio and one advantage per sequence: no per-token selection


@dataclass
class ClipCovConfig:
    enabled: bool = False
    ratio: float = 2e-4  # share of valid tokens detached (at least one)
    cov_lb: float = 1.0  # candidates: cov_lb < cov < cov_ub
    cov_ub: float = 5.0


@dataclass
class KlCovConfig:
    enabled: bool = False
    ratio: float = 2e-4  # share of valid tokens penalised, a fraction (the paper's 0.2 % = 2e-3)
    coef: float = 1.0  # penalty weight on |log pi - log pi_old| (verl's yaml default: 0.1)


@dataclass
class EntropyAdvConfig:
    enabled: bool = False
    alpha: float = 0.4  # 0.4 for GRPO, 0.1 for PPO in the paper
    kappa: float = 2.0  # bonus <= |A| / kappa, kappa > 1


@dataclass
class ForkConfig:
    enabled: bool = False
    top_frac: float = 0.2  # rho: the highest-entropy share of the micro-batch's tokens
    norm: str = "selected"  # "selected": normalise over the kept tokens (paper); "all": over every token (TRL)


@dataclass
class M2poConfig:
    enabled: bool = False
    threshold: float = 0.04  # tau_M2
    keep_clip: bool = False  # False: the ppo_clip recipes' eps-clip is dropped, as in M2PO


@dataclass
class LuffyConfig:
    enabled: bool = False
    traces: str = ""  # JSONL, one {"id": problem id, "completion": text} per line
    per_group: int = 1  # off-policy rows per advantage group (the rest stay on-policy)
    gamma: float = 0.1  # f(p) = p / (p + gamma)
    shape: str = "p_div_p"  # or "none": -A p


@dataclass
class DistillConfig:
    enabled: bool = False
    teacher: str = ""  # model spec: a local Hugging Face directory or a built-in name (same vocabulary)
    teacher_seed: int = 0  # weights of a built-in tiny teacher
    topk: int = 128  # the teacher's top-K tokens per position (verl's default)
    coef: float = 1.0  # weight of the distillation term in the loss
    log_prob_min: float = -10.0  # both log-probs clamped from below (verl's log_prob_min_clamp)
    loss_max: float = 10.0  # per-token loss clamped from above


@dataclass
class ReplayConfig:
    reuse_steps: int = 0  # S: new rollouts every S + 1 steps, each batch reused S times (0 = off)


PLUGINS = ("clip_cov", "kl_cov", "entropy_adv", "fork", "m2po", "luffy", "coach_guide", "distill", "rollout_corr",
           "dpo")
SEQUENCE_LEVEL_PLUGINS = ("dpo",)  # act on whole sequences: fine with the sequence-level losses


@dataclass
class PluginsConfig:
    clip_cov: ClipCovConfig = field(default_factory=ClipCovConfig)
    kl_cov: KlCovConfig = field(default_factory=KlCovConfig)
    entropy_adv: EntropyAdvConfig = field(default_factory=EntropyAdvConfig)
    fork: ForkConfig = field(default_factory=ForkConfig)
    m2po: M2poConfig = field(default_factory=M2poConfig)
    luffy: LuffyConfig = field(default_factory=LuffyConfig)
    coach_guide: CoachGuideConfig = field(default_factory=CoachGuideConfig)  # needs a coach recipe
    distill: DistillConfig = field(default_factory=DistillConfig)
    rollout_corr: RolloutCorrConfig = field(default_factory=RolloutCorrConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)  # not loss terms: not in enabled()
    prompt_filter: PromptFilterConfig = field(default_factory=PromptFilterConfig)

    def enabled(self) -> list[str]:
        return [name for name in PLUGINS if getattr(self, name).enabled]


def validate_plugins(plugins: PluginsConfig, policy_loss_name: str) -> None:
    """Raise ``ValueError`` naming the ``plugins.*`` key of an invalid or incompatible setting."""
    p = plugins
    checks = {
        "plugins.clip_cov.ratio": 0 < p.clip_cov.ratio <= 1,
        "plugins.clip_cov.cov_ub": p.clip_cov.cov_lb < p.clip_cov.cov_ub,
        "plugins.kl_cov.ratio": 0 < p.kl_cov.ratio <= 1,
        "plugins.kl_cov.coef": p.kl_cov.coef >= 0,
        "plugins.entropy_adv.alpha": p.entropy_adv.alpha > 0,
        "plugins.entropy_adv.kappa": p.entropy_adv.kappa > 1,
        "plugins.fork.top_frac": 0 < p.fork.top_frac <= 1,
        "plugins.fork.norm": p.fork.norm in ("selected", "all"),
        "plugins.m2po.threshold": p.m2po.threshold > 0,
        "plugins.luffy.per_group": p.luffy.per_group >= 1,
        "plugins.luffy.gamma": p.luffy.gamma > 0,
        "plugins.luffy.shape": p.luffy.shape in OFF_POLICY_SHAPES,
        "plugins.distill.teacher": bool(p.distill.teacher) or not p.distill.enabled,
        "plugins.distill.topk": p.distill.topk >= 1,
        "plugins.distill.coef": p.distill.coef > 0,
        "plugins.distill.loss_max": p.distill.loss_max > 0,
        "plugins.replay.reuse_steps": p.replay.reuse_steps >= 0,
        "plugins.prompt_filter.window": p.prompt_filter.window >= 1,
        "plugins.prompt_filter.readmit_after": p.prompt_filter.readmit_after >= 1,
        **rollout_corr_checks(p.rollout_corr),
        **dpo_checks(p.dpo),
        **coach_guide_checks(p.coach_guide),
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        values = ", ".join(f"{k}={_get(p, k)!r}" for k in bad)
        raise ValueError(f"invalid plug-in setting(s): {values} (see docs/plugins.md)")
    if p.luffy.enabled and not Path(p.luffy.traces).is_file():
        raise ValueError(f"plugins.luffy.traces: no such file {p.luffy.traces!r} (a JSONL of "
                         '{"id": problem id, "completion": text} rows)')
    on = p.enabled()
    if "clip_cov" in on and "kl_cov" in on:
        raise ValueError("plugins.clip_cov.enabled and plugins.kl_cov.enabled exclude each other "
                         "(two covariance rules for the same tokens)")
    token_level = [name for name in on if name not in SEQUENCE_LEVEL_PLUGINS]
    if token_level and policy_loss_name in SEQUENCE_LEVEL_LOSSES:
        raise ValueError(f"plugins.{token_level[0]}.enabled needs a token-level policy loss; the recipe's "
                         f"policy_loss is {policy_loss_name!r} (one ratio per sequence): use gspo_token, ppo_clip "
                         "or cispo")


def _get(plugins: PluginsConfig, dotted: str) -> Any:
    _, section, key = dotted.split(".")
    return getattr(getattr(plugins, section), key)


class TrainPlugins:
    """The enabled plug-ins of one run: builds a micro-batch's policy loss matrix and its metrics."""

    def __init__(self, plugins: PluginsConfig, seed: int) -> None:
        self.cfg = plugins
        self.seed = seed
        self._step, self._calls = -1, 0
        self.traces = load_traces(Path(plugins.luffy.traces)) if plugins.luffy.enabled else {}
        self.off_rows: set[int] = set()  # rows of the current step that are off-policy traces
        self.forced: dict[int, int] = {}  # plugins.coach_guide: row -> forced opening tokens of the current step
        self._teacher: torch.nn.Module | None = None
        # plugins.replay: (the batch, its behaviour log-probs, its LUFFY rows, the step it was sampled at)
        self._replay: tuple[Any, list[torch.Tensor], set[int], int] | None = None
        self.mismatch = MismatchMonitor()  # every run: the sampler's log-probs against the update's
        self.dpo = DpoTerm(plugins.dpo)  # plugins.dpo: per-row weights of the step, a surrogate per micro-batch

    @property
    def changes_loss(self) -> bool:
        """True when a plug-in is on: micro-batches then run whole, in one process, every row backward."""
        return bool(self.cfg.enabled())

    def _generator(self, step: int) -> torch.Generator:
        """Clip-Cov's draw: a pure function of (seed, step, call within the step), so a resumed run draws the
        same tokens."""
        if step != self._step:
            self._step, self._calls = step, 0
        self._calls += 1
        return torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 10_007 + self._calls)

    def policy_term(
        self, step: int, idx: list[int], loss_name: str, logp: torch.Tensor, old: torch.Tensor,
        adv: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor, loss_cfg: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """``(loss_mat [n, T], metrics, aggregation mask [n, T])`` of the recipe's policy loss with the
        enabled plug-ins for the micro-batch of step rows ``idx``; aggregate ``loss_mat`` over the returned
        mask with the recipe's mode.

        Order: advantages shaped (entropy_adv) -> base loss (kl_cov's unclipped form replaces ``ppo_clip``;
        M2PO drops the clip) -> LUFFY's shaped loss on the off-policy rows and on coach_guide's forced opening
        tokens -> Clip-Cov detach -> M2PO and
        forking masks (loss weights) -> rollout correction (weights and rejection, last: it reweights the
        finished per-token loss)."""
        c = self.cfg
        stats: dict[str, float] = {}
        if c.entropy_adv.enabled:
            adv, s = entropy_advantage(adv, mask, entropy=entropy, alpha=c.entropy_adv.alpha,
                                       kappa=c.entropy_adv.kappa)
            stats.update(s)
        loss_cfg = dict(loss_cfg)
        unclipped = loss_name == "ppo_clip" and c.m2po.enabled and not c.m2po.keep_clip
        if unclipped:  # clamp(r, 1 - inf, 1 + inf) = r: the surrogate -A r
            loss_cfg.update(clip_low=float("inf"), clip_high=float("inf"), clip_dual=None)
        if c.kl_cov.enabled and loss_name == "ppo_clip":
            pg_mat, s = kl_cov_loss(logp, old, adv, mask, ratio=c.kl_cov.ratio, coef=c.kl_cov.coef)
        else:
            pg_mat, s = policy_loss(loss_name, logp, old, adv, mask, **loss_cfg)
            if c.kl_cov.enabled:  # other token-level losses: the penalty is added on top
                chosen = kl_cov_selection(logp, adv, mask, ratio=c.kl_cov.ratio)
                penalty = kl_cov_penalty(logp, old, chosen, coef=c.kl_cov.coef)
                pg_mat = pg_mat + penalty
                n = float(mask.sum().clamp(min=1))
                s.update({"klcov/frac_tokens": float(chosen.sum()) / n,
                          "klcov/penalty": float((penalty.detach() * mask).sum()) / n})
        stats.update(s)
        if c.luffy.enabled:
            pg_mat, s = self._luffy(idx, logp, adv, mask, pg_mat)
            stats.update(s)
        if c.coach_guide.enabled:
            pg_mat, s = guided_policy_term(c.coach_guide, [self.forced.get(j, 0) for j in idx], logp, adv, mask,
                                           pg_mat)
            stats.update(s)
        if c.clip_cov.enabled:
            pg_mat, s = self._clip_cov(step, loss_name, logp, old, adv, mask, pg_mat, loss_cfg)
            stats.update(s)
        agg_mask = mask.to(pg_mat.dtype)
        if c.m2po.enabled:
            keep, s = m2po_mask(logp, old, adv, mask, threshold=c.m2po.threshold)
            pg_mat = pg_mat * keep  # the mean still runs over every valid token (M2PO's objective)
            stats.update(s)
        if c.fork.enabled:
            weight, agg_mask, s = token_mask(f"fork_{c.fork.norm}", entropy, mask, top_frac=c.fork.top_frac)
            pg_mat = pg_mat * weight
            stats.update(s)
        if c.rollout_corr.enabled:
            rollout, has = rows_tensor(self.mismatch.rows(idx), old)
            pg_mat, agg_mask, s = rollout_correction(c.rollout_corr, pg_mat, agg_mask, old, rollout, has, mask)
            stats.update(s)
        return pg_mat, stats, agg_mask

    def _clip_cov(self, step, loss_name, logp, old, adv, mask, pg_mat, loss_cfg
                  ) -> tuple[torch.Tensor, dict[str, float]]:
        """Detach a random subset of the mid-covariance tokens the base loss's clip has not already clipped."""
        c = self.cfg.clip_cov
        token_adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
        clipped = clipped_by_loss(loss_name, logp, old, token_adv, mask, loss_cfg)
        chosen = clip_cov_selection(logp, token_adv, mask, clipped & (mask > 0), ratio=c.ratio, cov_lb=c.cov_lb,
                                    cov_ub=c.cov_ub, generator=self._generator(step))
        n = float(mask.sum().clamp(min=1))
        stats = {"clipcov/frac_tokens": float(chosen.sum()) / n, "clipcov/n_tokens": float(chosen.sum())}
        return pg_mat * (~chosen).to(pg_mat.dtype), stats

    def extra_loss(self, trainer: Any, mb: Any, logits: torch.Tensor, total: torch.Tensor,
                   stats: dict[str, float]) -> torch.Tensor:
        """``total`` plus the terms a plug-in adds beyond the policy loss (``plugins.distill``: ``coef`` times
        the recipe's aggregation of the top-K forward KL to the teacher); updates ``loss/total``."""
        d = self.cfg.distill
        if not d.enabled:
            return total
        teacher = self.teacher(trainer, logits.shape[-1])
        temp = trainer.cfg.rollout.temperature if trainer.cfg.rollout.temperature > 0 else 1.0
        with torch.no_grad():
            t_logps = torch.log_softmax(trainer.logits_of(teacher, mb).float() / temp, dim=-1)
            t_top, t_ids = torch.topk(t_logps, min(d.topk, t_logps.shape[-1]), dim=-1)
        mask = mb.response_mask
        kl_mat, s = topk_forward_kl(logits / temp, t_top, t_ids, mask, log_prob_min=d.log_prob_min,
                                    loss_max=d.loss_max)
        kl = aggregate(kl_mat, mask, trainer.recipe.loss_agg, norm_len=trainer.cfg.rollout.max_new_tokens)
        total = total + d.coef * kl
        stats.update(s)
        stats["distill/loss"] = float(kl.detach())
        stats["loss/total"] = float(total.detach())
        return total

    def teacher(self, trainer: Any, vocab: int) -> torch.nn.Module:
        """The frozen teacher of ``plugins.distill``, loaded on first use; its vocabulary must be the policy's."""
        if self._teacher is None:
            from meshrl.models import load_model

            d = self.cfg.distill
            try:
                model, _ = load_model(d.teacher, dtype=trainer.cfg.train.dtype, seed=d.teacher_seed)
            except ValueError as e:
                raise ValueError(f"plugins.distill.teacher: {e}") from e
            size = model.get_output_embeddings().weight.shape[0]
            if size != vocab:
                raise ValueError(f"plugins.distill.teacher {d.teacher!r} has a vocabulary of {size} tokens, the "
                                 f"policy {vocab}: top-K distillation needs the same tokenizer")
            device = next(trainer.model.parameters()).device
            self._teacher = model.to(device).eval().requires_grad_(False)
        return self._teacher

    def _luffy(self, idx, logp, adv, mask, pg_mat) -> tuple[torch.Tensor, dict[str, float]]:
        """The off-policy rows take LUFFY's shaped, unclipped loss; the others keep the recipe's."""
        off = torch.tensor([j in self.off_rows for j in idx], dtype=torch.bool, device=logp.device)
        off_mask = mask * off[:, None].to(mask.dtype)
        shaped, s = luffy_off_policy_loss(logp, adv, off_mask, gamma=self.cfg.luffy.gamma,
                                          shape=self.cfg.luffy.shape)
        n = float(mask.sum().clamp(min=1))
        stats = {"offpolicy/frac_tokens": float(off_mask.sum()) / n, **s}
        return torch.where(off[:, None], shaped, pg_mat), stats

    def sample(self, trainer: Any) -> tuple[Any, int]:
        """The step's rollouts and the new problem cursor: fresh from the sampler, or (``plugins.replay``) the
        stored batch while it is younger than ``reuse_steps + 1`` steps. A fresh batch's behaviour log-probs
        are scored here, before any update moves the policy; a reused one logs ``rollouts/count`` 0 and its
        age (``replay/age``). The buffer is in the checkpoint (:meth:`state_dict`): a resumed run goes on with it."""
        s = self.cfg.replay.reuse_steps
        step = trainer.step_idx
        if s > 0 and self._replay is not None and step - self._replay[3] <= s:
            data, _, self.off_rows, born = self._replay
            stats = {**data.stats, "rollouts/count": 0.0, "time/rollout_s": 0.0, "replay/age": float(step - born)}
            self.begin_mismatch(trainer, data)
            return dataclasses.replace(data, stats=stats), trainer.cursor
        self.install_filter(trainer)
        data, cursor = trainer.sampler.run(step, trainer.cursor)
        if isinstance(trainer.sampler.sampler, FilteredProblems):
            data.stats.update(trainer.sampler.sampler.record(step, data.seen))
        data = self.mix(trainer, data)
        if self.cfg.coach_guide.enabled:
            data.stats.update(guide_step_stats(trainer.task, data))
        if s > 0:
            data.stats["replay/age"] = 0.0
            self._replay = (data, trainer._logps(trainer.model, data), set(self.off_rows), step)
        self.begin_mismatch(trainer, data)
        return data, cursor

    def install_filter(self, trainer: Any) -> FilteredProblems | None:
        """``plugins.prompt_filter``: wrap the trainer's problem stream (once); return the filter."""
        if not self.cfg.prompt_filter.enabled:
            return None
        if not isinstance(trainer.sampler.sampler, FilteredProblems):
            trainer.sampler.sampler = FilteredProblems(trainer.sampler.sampler, trainer.problems,
                                                       self.cfg.prompt_filter)
        return trainer.sampler.sampler

    def state_dict(self, trainer: Any) -> dict[str, Any] | None:
        """What must survive a resume (JSON): the replay buffer and the prompt filter's state; None when neither
        plug-in is on."""
        from meshrl.trainer.plugin_state import replay_to_json

        out: dict[str, Any] = {}
        if self.cfg.replay.reuse_steps > 0:
            out["replay"] = replay_to_json(self._replay)
        if self.cfg.prompt_filter.enabled:
            out["prompt_filter"] = self.install_filter(trainer).state_dict()
        return out or None

    def load_state_dict(self, trainer: Any, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output; a checkpoint without it (written before plug-in state was kept)
        starts a new replay cycle and an empty filter history, with a warning."""
        import logging

        from meshrl.trainer.plugin_state import replay_from_json

        state = state or {}
        needed = [k for k, on in (("replay", self.cfg.replay.reuse_steps > 0),
                                  ("prompt_filter", self.cfg.prompt_filter.enabled)) if on and k not in state]
        if needed:
            logging.getLogger("meshrl").warning("the checkpoint has no state of plugins.%s: the resumed run starts it "
                                                "afresh", ", plugins.".join(needed))
        by_id = {str(p.id): p for p in trainer.problems}
        if state.get("replay") is not None:
            self._replay = replay_from_json(state["replay"], by_id)
        if state.get("prompt_filter") is not None:
            self.install_filter(trainer).load_state_dict(state["prompt_filter"])

    def begin_mismatch(self, trainer: Any, data: Any) -> None:
        """Start the step's mismatch record; ``plugins.rollout_corr`` needs the sampler's log-probs."""
        self.forced = {i: n for i, n in enumerate(data.forced_tokens) if n}
        self.mismatch.begin(data, self.off_rows | set(self.forced))
        sampled = [r for j, r in enumerate(data.rollout_logps) if j not in self.off_rows and j not in self.forced]
        if self.cfg.rollout_corr.enabled and sampled and all(r is None for r in sampled):
            raise ValueError(f"plugins.rollout_corr.enabled: the rollout backend {trainer.backend.name!r} returned no "
                             "log-probs of its samples")

    def observe_old(self, idx: list[int], old: torch.Tensor, mask: torch.Tensor) -> None:
        """The update's old-policy log-probs of micro-batch rows ``idx`` (the mismatch diagnostic)."""
        self.mismatch.observe(idx, old, mask)

    def mismatch_metrics(self, trainer: Any) -> dict[str, float]:
        """``mismatch/*`` of the step just updated (and, once, an event naming backend and precisions)."""
        out = self.mismatch.finish()
        if out:
            event = self.mismatch.setup_event(trainer)
            if event is not None:
                trainer.pending_events.append(event)
        return out

    def behaviour_logps(self, data: Any, old_logps: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """``plugins.replay``: a reused batch's ratio is against the policy that sampled it, not the current one."""
        if self._replay is not None and data.texts is self._replay[0].texts and data.stats.get("replay/age", 0) > 0:
            return self._replay[1]
        return old_logps

    def mix(self, trainer: Any, data: Any) -> Any:
        """LUFFY's mixed groups: in each advantage group, the last ``plugins.luffy.per_group`` rollouts are
        replaced by off-policy traces of the problem (scored by the task like any rollout), and rewards and
        advantages are recomputed over the mixed group. Groups without a trace for their problem, or with no
        on-policy row left, stay on-policy; traces longer than ``rollout.max_new_tokens`` are skipped; both
        are counted (``offpolicy/groups_without_trace``, ``offpolicy/skipped_long``)."""
        self.off_rows = set()
        if not self.cfg.luffy.enabled or not len(data):
            return data
        groups: dict[Any, list[int]] = {}
        for i, g in enumerate(data.group_ids):
            groups.setdefault(g, []).append(i)
        k, missing, too_long = self.cfg.luffy.per_group, 0, 0
        max_len = trainer.cfg.rollout.max_new_tokens
        for rows in groups.values():
            problem = data.problems[rows[0]]
            texts = self.traces.get(str(problem.id))
            if not texts or len(rows) <= k:
                missing += 1
                continue
            for n, i in enumerate(rows[-k:]):
                text = texts[(data.query_ids[i] + n) % len(texts)]
                ids = trace_ids(trainer.tokenizer, text)
                if len(ids) > max_len:
                    too_long += 1
                    continue
                data.response_ids[i], data.texts[i], data.truncated[i] = ids, text, False
                if i < len(data.rollout_logps):
                    data.rollout_logps[i] = None  # a trace was not sampled: no sampler log-probs
                if i < len(data.forced_tokens):
                    data.forced_tokens[i] = 0  # a whole trace is off-policy: no coach_guide opening in it
                data.scores[i] = trainer.sampler.rewards([text], [problem])[0]
                self.off_rows.add(i)
        # The same shaping and advantages as RolloutStep.run, now over the mixed groups.
        data.rewards = trainer.sampler._shape(data)
        scale = "none" if trainer.recipe.adv_scale == "none" else "std"
        data.advantages = group_advantages(data.rewards, data.group_ids, scale=scale)
        off_scores = [data.scores[i] for i in self.off_rows]
        data.stats.update({"offpolicy/rows": float(len(self.off_rows)),
                           "offpolicy/score_mean": sum(off_scores) / len(off_scores) if off_scores else 0.0,
                           "offpolicy/groups_without_trace": float(missing),
                           "offpolicy/skipped_long": float(too_long)})
        return data


def clipped_by_loss(loss_name: str, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    loss_cfg: dict[str, Any]) -> torch.Tensor:
    """``[n, T]`` bool: the tokens whose gradient the recipe's own clip already removed (Clip-Cov leaves them out
    of its candidates). ``ppo_clip``: ``A>0, r>1+eh`` or ``A<0, r<1-el`` on the token ratio, and with a dual clip
    ``A<0, r>c``; ``gspo_token``: the same bounds on the sequence ratio ``s_i`` (its value for every token of the
    row); ``cispo`` clips the weight, never the gradient: none."""
    ratio = (logp.detach() - old).exp()
    low, high = loss_cfg.get("clip_low", 0.2), loss_cfg.get("clip_high", 0.2)
    if loss_name == "cispo":
        return torch.zeros_like(ratio, dtype=torch.bool)
    if loss_name == "gspo_token":
        m = mask.to(ratio.dtype)
        seq = (((logp.detach() - old) * m).sum(-1) / m.sum(-1).clamp(min=1)).exp()
        return _clipped_tokens(seq[:, None].expand_as(ratio), adv, low, high)
    clipped = _clipped_tokens(ratio, adv, low, high)
    if loss_cfg.get("clip_dual") is not None:  # -A c: a constant, no gradient
        clipped = clipped | ((adv < 0) & (ratio > loss_cfg["clip_dual"]))
    return clipped


def trace_ids(tokenizer: Any, text: str) -> list[int]:
    """Response token ids of an off-policy trace: its tokens and the eos that ends a finished rollout."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids + [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else ids


def load_traces(path: Path) -> dict[str, list[str]]:
    """``problem id -> [completion, ...]`` from a JSONL of ``{"id": ..., "completion": ...}`` rows; a bad row
    raises ``ValueError`` naming the file, the line and the field."""
    out: dict[str, list[str]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: a row must be a JSON object")
        for key in ("id", "completion"):
            if key not in row:
                raise ValueError(f"{path}:{n}: missing field {key!r}")
        if not isinstance(row["completion"], str) or not row["completion"]:
            raise ValueError(f"{path}:{n}: field 'completion' must be a non-empty string")
        out.setdefault(str(row["id"]), []).append(row["completion"])
    if not out:
        raise ValueError(f"{path}: no traces")
    return out
