"""Mesh Learning settings of a verl run, read from the ``meshrl`` block of verl's Hydra config (no verl import).

A verl user adds them as ``+meshrl.mu=5e-5 +meshrl.subtract_ref=true ...``; :func:`settings_from_config` checks
every key and value before the first step, so a typo fails at start-up, not silently.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from meshrl.mesh import REDUCTIONS
from meshrl.runs.correct import CORRECT_AT

#: Per-sample fields the meshrl trainer writes into each verl batch row and the loss wrapper reads.
QUERY_ID = "meshrl_query_id"
STRATEGY_ID = "meshrl_strategy_id"
CORRECT = "meshrl_correct"
BALANCE_WEIGHT = "meshrl_balance_weight"
#: Keys of a dataset row's ``extra_info`` that carry the ids (written by ``meshrl export verl``).
EXTRA_QUERY_ID = "query_id"
EXTRA_STRATEGY_ID = "strategy_id"
#: A rollout is correct when its score reaches ``CORRECT_AT`` (meshrl's own trainer's cut, imported from it).
__all__ = ["BALANCE_WEIGHT", "CORRECT", "CORRECT_AT", "EXTRA_QUERY_ID", "EXTRA_STRATEGY_ID", "QUERY_ID",
           "STRATEGY_ID", "MeshSettings", "settings_from_config"]


@dataclass(frozen=True)
class MeshSettings:
    """The Mesh knobs that act inside verl (the prefixes, m and the budget are in the exported data)."""

    mu: float = 1e-5  # strategy-balancing strength (0 = Coach Prompting only, the paper's cp_only arm)
    subtract_ref: bool = True  # r = z - z_ref (paper); False = the release variant without the reference
    reduction: str = "mean"  # over queries: "mean", "mean_active" or "sum" (the release)
    js_coef: float = 0.0  # beta of the sampled JS(pi, pi_ref) penalty (needs verl's reference log-probs)
    mei_sketch: int = 0  # MEI from count-sketched bias features of this many buckets (0 = off; e.g. 64)
    mei_seed: int = 0  # seed of the sketch's hashes and signs
    health_every: int = 0  # meshrl doctor's checks every this many steps (0 = off; docs/doctor.md)
    health_on: Mapping = dataclasses.field(default_factory=dict)  # action per finding id / severity
    health_dir: str = ""  # where health_events.jsonl goes ("" = trainer.default_local_dir)
    health_samples_dir: str = ""  # verl's generation dumps for the completion checks ("" = trainer.rollout_data_dir)

    def __post_init__(self) -> None:
        for name in ("mu", "js_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"meshrl.{name} must be a finite number >= 0, got {v!r}")
        for name in ("mei_sketch", "mei_seed", "health_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"meshrl.{name} must be an integer >= 0, got {v!r}")
        if not isinstance(self.health_on, Mapping):
            raise ValueError(f"meshrl.health_on must be a mapping of finding id or severity to an action, got "
                             f"{self.health_on!r}")
        from meshrl.doctor.live import check_actions

        object.__setattr__(self, "health_on", check_actions({str(k): v for k, v in self.health_on.items()},
                                                            where="meshrl.health_on"))
        if not isinstance(self.subtract_ref, bool):
            raise ValueError(f"meshrl.subtract_ref must be true or false, got {self.subtract_ref!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"meshrl.reduction must be one of {', '.join(REDUCTIONS)}, got {self.reduction!r}")

    @property
    def needs_reference(self) -> bool:
        """True when verl must compute reference log-probs (``ref_log_prob``) for meshrl's terms."""
        return self.js_coef > 0 or (self.mu > 0 and self.subtract_ref)


def settings_from_config(block: Mapping | None) -> MeshSettings:
    """:class:`MeshSettings` from the ``meshrl`` config block (a mapping or ``None``); unknown keys raise."""
    if block is None:
        return MeshSettings()
    if not isinstance(block, Mapping):
        raise ValueError(f"the meshrl config block must be a mapping, got {type(block).__name__}")
    known = {f.name for f in dataclasses.fields(MeshSettings)}
    unknown = sorted(set(block) - known)
    if unknown:
        raise ValueError(f"unknown meshrl setting(s) {unknown}; known: {sorted(known)}")
    values = dict(block)
    if "mu" in values and isinstance(values["mu"], int) and not isinstance(values["mu"], bool):
        values["mu"] = float(values["mu"])
    return MeshSettings(**values)
