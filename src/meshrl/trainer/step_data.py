"""One step's rollouts: :class:`StepData`, columns of one row per sample, and :class:`Sample`, one row as a record.

The columns are what the update reads in bulk (prompt and response ids per micro-batch, scores for the advantages);
:class:`Sample` is the row a plug-in or the sampler writes whole (:meth:`StepData.append`, :meth:`StepData.row`,
:meth:`StepData.replace_row`, :meth:`StepData.select`), so that no caller lists the columns by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Sample:
    """One rollout as a record: the fields of one row of :class:`StepData` (see there for each)."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    truncated: bool
    problem: Any
    group_id: Any
    query_id: int
    strategy_id: int
    score: float
    rollout_logps: list[float] | None = None
    rollout_features: np.ndarray | None = None
    origin: str = ""
    unsampled: int = 0
    response_mask: list[int] | None = None
    label_text: str | None = None


#: Sample field -> StepData column
ROW_COLUMNS = {"prompt_ids": "prompt_ids", "response_ids": "response_ids", "text": "texts", "truncated": "truncated",
               "problem": "problems", "group_id": "group_ids", "query_id": "query_ids", "strategy_id": "strategy_ids",
               "score": "scores", "rollout_logps": "rollout_logps", "rollout_features": "rollout_features",
               "origin": "origin", "unsampled": "unsampled", "response_mask": "response_masks",
               "label_text": "label_texts"}
#: the columns a batch may carry for its first rows only (shorter lists), and the value a missing entry stands for
OPTIONAL_DEFAULTS: dict[str, Any] = {"rollout_features": None, "origin": "", "unsampled": 0, "response_mask": None,
                                     "label_text": None}
#: columns only multi-turn episodes fill (empty otherwise: every response token is the model's; label = text)
EPISODE_ONLY = ("response_mask", "label_text")


@dataclass
class StepData:
    """Rollouts of one training step, flattened to one row per sample."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    problems: list[Any] = field(default_factory=list)
    group_ids: list[Any] = field(default_factory=list)  # advantage group: draw, or (draw, prefix)
    query_ids: list[int] = field(default_factory=list)  # one id per problem draw (the cursor position)
    strategy_ids: list[int] = field(default_factory=list)  # coach prefix index, -1 without a coach
    scores: list[float] = field(default_factory=list)  # task score in [0, 1]
    # The sampler's own log-prob of each response token (Rollouts.engine_logprobs), None for a row that has none
    # (a backend without them, an off-policy trace): compared with the update's in the mismatch diagnostic.
    rollout_logps: list[list[float] | None] = field(default_factory=list)
    # The sampler's MEI ``bias`` features of each row (Rollouts.engine_features: float32 [V]), None for a row that
    # has none (not asked for this step, a backend or an episode without them, an off-policy trace or a forced
    # opening). They describe the policy that sampled the row, so the trainer takes them once, at the update that
    # follows the sampling (:meth:`take_rollout_features`); a batch reused later carries none.
    rollout_features: list[np.ndarray | None] = field(default_factory=list)
    # Where the sampler's log-probs are taken under its truncated distribution (vLLM, rollout.top_p < 1): per row,
    # log of the tempered mass its top-p set keeps at each response token, under the policy at the update's start
    # (set by the update; None otherwise). ``rollout_logps + rollout_log_kept`` is then the sampler's log-prob over
    # the whole vocabulary, the quantity the trainer's log-probs are (meshrl.rollout.truncation).
    rollout_log_kept: list[torch.Tensor] | None = None
    # Provenance, per row: ``origin`` is "" for a row the policy sampled from its prompt, else the name of the
    # plug-in that made it or forced part of it (a forced opening, an off-policy trace); ``unsampled`` is how many
    # leading response tokens the sampler did not choose (0: every one; an opening's length; a whole trace's).
    origin: list[str] = field(default_factory=list)
    unsampled: list[int] = field(default_factory=list)
    # Multi-turn episodes: per row, 1 on each response token the model sampled and 0 on the environment's tokens
    # (tool output) between its turns; every loss term, metric and MEI reads only the 1s. Empty, or None for a
    # row: every response token is the model's (single-turn rollouts).
    response_masks: list[list[int] | None] = field(default_factory=list)
    # Multi-turn episodes: what the strategy labeller reads per row (the model's turns, tool calls included:
    # EnvTask labels the tool pattern); empty: the texts. Kept rows carry theirs into the step's batch.
    label_texts: list[str] = field(default_factory=list)
    rewards: torch.Tensor | None = None  # shaped reward [N]
    advantages: torch.Tensor | None = None  # [N]
    stats: dict[str, float] = field(default_factory=dict)
    # Every rollout sampled this step, before dynamic sampling dropped any group: (text, score, problem).
    # Strategy masses and per-type accuracy describe the policy, so they use these, not the kept rows.
    seen: list[tuple[str, float, Any]] = field(default_factory=list)
    # With lagged rollouts (rollout.max_staleness >= 1), per row: the policy version (optimiser steps of the
    # trainer) whose weights sampled it (meshrl.trainer.lagged_rollouts); empty otherwise (the current policy's).
    policy_versions: list[int] = field(default_factory=list)

    def extend(self, other: StepData, keep: list[int]) -> None:
        if other.response_masks or self.response_masks:
            self.response_masks.extend([None] * (len(self) - len(self.response_masks)))
            self.response_masks.extend(other.model_mask(i) for i in keep)
        for name, column in ROW_COLUMNS.items():
            if name not in OPTIONAL_DEFAULTS:
                getattr(self, column).extend(getattr(other, column)[i] for i in keep)
        self.rollout_features.extend(other.rollout_features[i] if i < len(other.rollout_features) else None
                                     for i in keep)
        self.origin.extend(other.origin[i] if i < len(other.origin) else "" for i in keep)
        self.unsampled.extend(other.unsampled[i] if i < len(other.unsampled) else 0 for i in keep)
        if other.label_texts:
            self.label_texts.extend(other.label_texts[i] for i in keep)

    def __len__(self) -> int:
        return len(self.texts)

    def rows_from(self, origin: str) -> set[int]:
        """The rows whose ``origin`` is ``origin`` (a plug-in's name)."""
        return {i for i, o in enumerate(self.origin) if o == origin}

    # ------------------------------------------------------------------ rows as typed records
    def row(self, i: int) -> Sample:
        """Row ``i`` as a :class:`Sample` (a column a batch does not carry gives its default)."""
        values = {}
        for name, column in ROW_COLUMNS.items():
            col = getattr(self, column)
            values[name] = col[i] if i < len(col) else OPTIONAL_DEFAULTS[name]
        return Sample(**values)

    def append(self, sample: Sample) -> None:
        """Add ``sample`` as the last row. A column shorter than the batch is filled with its default first; the
        episode-only columns (:data:`EPISODE_ONLY`) get an entry only when the sample has one or the column is
        already in use."""
        n = len(self)
        for name, column in ROW_COLUMNS.items():
            col, value = getattr(self, column), getattr(sample, name)
            if name in EPISODE_ONLY and value is None and not col:
                continue
            if len(col) < n:
                col.extend([OPTIONAL_DEFAULTS[name]] * (n - len(col)))
            col.append(value)

    def replace_row(self, i: int, sample: Sample) -> None:
        """Put ``sample`` in row ``i``'s place; an optional column shorter than the batch is filled with defaults
        first when the sample needs it."""
        for name, column in ROW_COLUMNS.items():
            col, value = getattr(self, column), getattr(sample, name)
            if i >= len(col):
                if name not in OPTIONAL_DEFAULTS or value == OPTIONAL_DEFAULTS[name]:
                    continue
                col.extend([OPTIONAL_DEFAULTS[name]] * (len(self) - len(col)))
            col[i] = value

    def select(self, rows: list[int]) -> StepData:
        """A new batch of ``rows`` (in that order), with their rewards and advantages and this batch's stats."""
        out = StepData()
        out.extend(self, rows)
        idx = torch.tensor(rows, dtype=torch.long)
        out.rewards = None if self.rewards is None else self.rewards[idx]
        out.advantages = None if self.advantages is None else self.advantages[idx]
        out.stats = dict(self.stats)
        return out

    def take_rollout_features(self) -> tuple[torch.Tensor | None, int]:
        """``(features [rows, V] float32, rows without)``: the sampler's features of every row stacked, or None
        when some row has none; every row's entry becomes None (they belong to the sampling policy, which the
        update is about to change; cleared in place, so that a batch a plug-in keeps, sharing the list, has none)."""
        feats = [self.rollout_features[i] if i < len(self.rollout_features) else None for i in range(len(self))]
        self.rollout_features[:] = [None] * len(self.rollout_features)
        missing = sum(f is None for f in feats)
        if missing or not feats:
            return None, missing
        return torch.from_numpy(np.stack(feats).astype(np.float32, copy=False)), 0

    def model_mask(self, row: int) -> list[int] | None:
        """Row ``row``'s model-token mask (``response_masks``), or None when all its tokens are the model's."""
        return self.response_masks[row] if row < len(self.response_masks) else None


