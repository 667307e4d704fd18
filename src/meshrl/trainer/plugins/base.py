"""What a plug-in is: a config section, the stage of the step it acts at, and the hooks it overrides.

A plug-in is one class in one file of this package (or any importable module, named in ``plugins.custom``),
registered with :func:`register`. The trainer looks plug-ins up here; nothing else names them. A class declares

- ``name``: its config section, ``plugins.<name>``;
- ``Config``: a dataclass of :func:`meshrl.settings.setting` fields (help and bounds, once);
- ``stage`` and ``order``: where its loss hooks run in a micro-batch's policy term (:class:`Stage`; ties by
  ``order``), so that the composition of several plug-ins is fixed and documented;
- ``token_level``: True when it needs per-token ratios (refused with GSPO's one-ratio-per-sequence loss);
- ``excludes``: names of plug-ins it cannot be combined with.

and overrides only the hooks it needs (each a no-op here; :data:`SAMPLING_HOOKS`, :data:`UPDATE_HOOKS`,
:data:`STATE_HOOKS` and :data:`CONFIG_HOOKS` name them by who calls them). A plug-in that overrides an update hook
gets the serial update engine, whole micro-batches in one process (``meshrl.trainer.update``). The step calls them
in this order:

1. sampling: :meth:`Plugin.reuse_batch` (the first plug-in that returns a stored batch ends the sampling), else
   :meth:`Plugin.before_sampling`, the sampler, :meth:`Plugin.after_sampling` (each plug-in's output is the next
   one's input) and :meth:`Plugin.batch_ready` (the final batch);
2. update start: :meth:`Plugin.behaviour_logps` (the log-probs the ratio is taken against), then
   :meth:`Plugin.begin_update` (per-row weights from the start policy, e.g. DPO);
3. each micro-batch: :meth:`Plugin.shape_advantages` -> :meth:`Plugin.loss_settings` / :meth:`Plugin.base_loss` ->
   :meth:`Plugin.transform` (in stage order) -> :meth:`Plugin.extra_loss` -> :meth:`Plugin.surrogate`;
4. checkpoints: :meth:`Plugin.state_dict` / :meth:`Plugin.load_state_dict`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

import torch


class Stage(IntEnum):
    """Where a plug-in acts; loss hooks run in this order within a micro-batch."""

    SAMPLING = 0  # changes which rollouts the step trains on (replay, prompt filter)
    ADVANTAGE = 1  # reshapes the advantages before the loss (entropy advantage)
    BASE_LOSS = 2  # replaces or modifies the recipe's policy loss (KL-Cov, M2PO's unclipped ratio)
    OFF_POLICY = 3  # a shaped loss on tokens the policy did not sample (LUFFY traces, coach-guided openings)
    TOKEN_SELECTION = 4  # which tokens carry gradient, and with what weight (Clip-Cov, M2PO, forking tokens)
    CORRECTION = 5  # reweights the finished per-token loss (rollout importance correction)
    EXTRA_LOSS = 6  # adds a term beyond the policy loss (distillation, DPO)


@dataclass
class PluginContext:
    """What a plug-in may use from the run: settings, the recipe, the policy's forward and the task."""

    cfg: Any  # the RunConfig
    recipe: Any  # the resolved algos.Recipe
    forward: Any  # trainer.forward.PolicyForward: logits, per-row log-probs, the model
    tokenizer: Any
    task: Any
    problems: list[Any]
    seed: int
    rollouts: Any  # trainer.rollout_step.RolloutStep: the problem stream, the reward runner, reward shaping


@dataclass
class TokenTerms:
    """One micro-batch's inputs to the policy term (all ``[n, T]`` but ``adv``, ``[n]`` or ``[n, T]``)."""

    step: int  # the step's index (0-based)
    rows: list[int]  # the step rows of the micro-batch
    loss_name: str  # the recipe's policy loss
    logp: torch.Tensor  # log pi_theta of the response tokens (with graph)
    old: torch.Tensor  # log pi_old (detached)
    adv: torch.Tensor  # advantages, after the ADVANTAGE stage
    mask: torch.Tensor  # valid response tokens, 0/1
    entropy: torch.Tensor  # per-token entropy (detached)
    loss_cfg: dict[str, Any]  # the policy loss's clip settings, after the BASE_LOSS stage
    batch: Any  # the step's StepData (off-policy rows, forced openings, the sampler's log-probs)


Stats = dict[str, float]


class Plugin:
    """Base class of a plug-in (see the module docstring); every hook defaults to doing nothing."""

    name: ClassVar[str] = ""
    Config: ClassVar[type] = type(None)
    stage: ClassVar[Stage] = Stage.TOKEN_SELECTION
    order: ClassVar[float] = 0.0
    token_level: ClassVar[bool] = True
    excludes: ClassVar[tuple[str, ...]] = ()
    needs_reference: ClassVar[bool] = False  # scores rollouts under the frozen reference (the trainer keeps one)
    episodes_ok: ClassVar[bool] = True  # False: reads a response as one sampled stream (refused for tool episodes)
    # Lagged rollouts (rollout.max_staleness >= 1, meshrl.trainer.lagged_rollouts): a plug-in with sampling hooks
    # is refused unless they only check a batch (``lag_safe``); ``lag_refusal`` refuses one for its own reason;
    # ``corrects_staleness`` is the rollout.staleness_correction value the plug-in implements.
    lag_safe: ClassVar[bool] = False
    lag_refusal: ClassVar[str] = ""
    corrects_staleness: ClassVar[str] = ""
    # True: every update hook the plug-in overrides leaves a row with advantage 0 an exactly zero gradient (its terms
    # multiply the policy term, and read the micro-batch's other values, never their graphs), so that the serial
    # update engine may forward such rows without a graph (train.skip_zero_advantage; meshrl.trainer.update).
    zero_advantage_exact: ClassVar[bool] = False
    summary: ClassVar[str] = ""  # one line for the docs and `--help-config`

    def __init__(self, cfg: Any, ctx: PluginContext) -> None:
        self.cfg, self.ctx = cfg, ctx

    # ---- configuration
    @classmethod
    def is_enabled(cls, cfg: Any) -> bool:
        """Whether the section turns the plug-in on (``enabled`` by default)."""
        return bool(getattr(cfg, "enabled", False))

    @classmethod
    def uses_reference(cls, cfg: Any) -> bool:
        """Whether this setting of the plug-in scores rollouts under the frozen reference (``needs_reference``
        unless a setting decides it)."""
        return cls.needs_reference

    @classmethod
    def check(cls, cfg: Any, run_cfg: Any) -> None:
        """Raise ``ValueError`` naming the key for settings only the whole config can judge (bounds of single
        fields are declared on ``Config`` and checked for every plug-in, enabled or not)."""

    # ---- sampling
    def opening(self, problem: Any, strategy: int) -> tuple[list[int], str]:
        """``(token ids, text)`` a rollout of coach arm ``strategy`` (>= 0) of ``problem`` must start its response
        with (``([], "")``: a free rollout). A plug-in that overrides this makes the coach arms sample the
        unconditioned prompt with its opening forced (:mod:`meshrl.trainer.openings`); at most one may."""
        return [], ""

    def before_sampling(self, sampler: Any) -> None:
        """Before the step's rollouts are drawn (e.g. wrap the problem stream)."""

    def reuse_batch(self, step: int, cursor: int) -> tuple[Any, int] | None:
        """A stored batch to train on instead of sampling, with the cursor to keep; None to sample."""
        return None

    def after_sampling(self, step: int, data: Any, sampler: Any) -> Any:
        """The step's fresh rollouts, possibly changed (mixed traces, extra statistics)."""
        return data

    def batch_ready(self, step: int, data: Any) -> None:
        """The step's fresh batch as the update will see it, after every plug-in's :meth:`after_sampling` (a
        plug-in that keeps the batch keeps this one, not an earlier stage's)."""

    def behaviour_logps(self, data: Any, old_logps: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """The log-probs the ratio is taken against (a reused batch: those of the policy that sampled it)."""
        return old_logps

    # ---- the update
    def begin_update(self, data: Any, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> Stats:
        """Once per update, at the start parameters; metrics (``<ns>/term`` is added to ``loss/total``).
        ``start_logps`` / ``ref_logps``: per-row token log-probs of the start policy and the reference when the
        update computed them anyway, else None (score them through ``ctx.forward`` if needed)."""
        return {}

    def shape_advantages(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats]:
        return terms.adv, {}

    def loss_settings(self, loss_name: str, loss_cfg: dict[str, Any]) -> dict[str, Any]:
        return loss_cfg

    def base_loss(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats] | None:
        """The per-token policy loss ``[n, T]`` in place of the recipe's, or None to keep the recipe's."""
        return None

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        """``(loss [n, T], aggregation mask [n, T], metrics)`` after this plug-in's change."""
        return pg_mat, agg_mask, {}

    def extra_loss(self, mb: Any, logits: torch.Tensor, total: torch.Tensor, stats: Stats) -> torch.Tensor:
        """The micro-batch's total loss with this plug-in's term added (update ``stats`` in place)."""
        return total

    def surrogate(self, rows: list[int], seq_logp: torch.Tensor) -> torch.Tensor | float:
        """A term added to the micro-batch's weighted loss whose gradient is the plug-in's (row weights)."""
        return 0.0

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None: the checkpoint has none)."""


#: The hooks by the part of the run that calls them; every public method of :class:`Plugin` is in exactly one
#: (tests/unit/test_plugin_hooks.py).
CONFIG_HOOKS = ("is_enabled", "uses_reference", "check")  # class methods, when the config is read
SAMPLING_HOOKS = ("opening", "before_sampling", "reuse_batch", "after_sampling", "batch_ready",
                  "behaviour_logps")  # the batch: from its sampling to the log-probs its ratio is taken against
UPDATE_HOOKS = ("begin_update", "shape_advantages", "loss_settings", "base_loss", "transform", "extra_loss",
                "surrogate")  # the update's terms: overriding one means the serial update engine
STATE_HOOKS = ("state_dict", "load_state_dict")  # checkpoints

REGISTRY: dict[str, type[Plugin]] = {}


def register(cls: type[Plugin]) -> type[Plugin]:
    """Class decorator: make a plug-in known under ``cls.name`` (its config section ``plugins.<name>``)."""
    if not cls.name or not dataclasses.is_dataclass(cls.Config):
        raise TypeError(f"plug-in {cls.__qualname__} needs a name and a Config dataclass")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"a plug-in named {cls.name!r} is already registered ({REGISTRY[cls.name].__module__})")
    REGISTRY[cls.name] = cls
    return cls
