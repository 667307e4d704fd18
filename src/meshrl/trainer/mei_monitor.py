"""MEI in the training loop: the ``bias`` features of the step's rollouts, threshold warnings.

The ``bias`` feature map, ``phi_i = sum_t (e_{y_t} - softmax(z_t / T))``, needs only the distributions the
rollouts were sampled from. The in-process samplers (``native``, ``hf``) sum it while they sample
(``Rollouts.engine_features``), at the cost of one ``[rows, V]`` add per decode step, and the monitor takes
those; the update then runs as it would without MEI (worker processes, zero-advantage rows skipped). Where some
row has no sampler features (``vllm``, multi-turn episodes, reused or off-policy rows, coach-guided openings),
the monitor is fed from inside the loss computation during the first PPO epoch instead, when every rollout
passes through exactly once, which makes that epoch run every row whole in one process
(:class:`meshrl.trainer.update.StepPlan`). The source is logged whenever it changes. The ``head`` and ``full``
maps need hidden states or per-sample gradients and are offered offline (``meshrl mei calibrate``,
``meshrl census``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("meshrl")


def load_threshold(spec: str | float | None, feature: str, group_size: int) -> float | None:
    """A number, or the ``threshold`` of a ``meshrl mei calibrate`` JSON (checked against the run)."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, int | float):
        return float(spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"diag.mei.threshold: {spec!r} is neither a number nor an existing file")
    data = json.loads(path.read_text())
    for key in ("threshold", "feature", "group_size"):
        if key not in data:
            raise ValueError(f"diag.mei.threshold file {path} lacks the field {key!r}")
    if data["feature"] != feature:
        raise ValueError(f"{path} was calibrated with feature {data['feature']!r}, the run uses {feature!r}")
    if int(data["group_size"]) != group_size:
        log.warning("%s was calibrated with group size %s, the run's query groups have %d rollouts: MEI scales "
                    "with G, recalibrate for a fair threshold", path, data["group_size"], group_size)
    return float(data["threshold"])


class MeiMonitor:
    def __init__(self, cfg, group_size: int) -> None:
        mc = cfg.diag.mei
        if mc.feature != "bias":
            raise ValueError(f"diag.mei.feature={mc.feature!r}: the trainer computes the 'bias' map online; "
                             "use `meshrl mei calibrate --feature head` or `meshrl census` offline")
        self.every, self.feature, self.patience = mc.every, mc.feature, max(1, mc.patience)
        self.threshold = load_threshold(mc.threshold, mc.feature, group_size)
        self.mesh = cfg.mesh_enabled
        self.temperature = cfg.rollout.temperature
        self.above, self.first_cross, self.warned = 0, None, False
        self._phi: torch.Tensor | None = None
        self._source: str | None = None  # the features' source last logged

    def active(self, step_idx: int) -> bool:
        return self.every > 0 and step_idx % self.every == 0

    def begin(self, n_rows: int, features: torch.Tensor | None = None, reason: str | None = None) -> bool:
        """Start a step's MEI over ``n_rows`` rows: from the sampler's ``features [n_rows, V]`` when given, else
        from the update's forward (``reason``: why, logged when the source changes). True when the update must
        feed the monitor (:meth:`add_logits`)."""
        self._phi, self._n = None, n_rows
        if features is not None:
            if features.shape[0] != n_rows:
                raise ValueError(f"MEI: sampler features for {features.shape[0]} rows, the step has {n_rows}")
            self._phi = features.float()
            self._log_source("MEI features from the rollout (the sampler's distributions)")
            return False
        if reason is not None:
            self._log_source(f"MEI features from the update's forward: {reason}")
        return True

    def _log_source(self, source: str) -> None:
        if source != self._source:
            log.info("%s", source)
            self._source = source

    def add(self, idx: list[int], logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
            temperature: float) -> None:
        from meshrl.diagnostics import bias_features

        feats = bias_features(logits, tokens, mask, temperature=temperature if temperature > 0 else 1.0)
        if self._phi is None:
            self._phi = torch.zeros(self._n, feats.shape[1], dtype=torch.float32)
        self._phi[idx] = feats.float().cpu()

    def add_logits(self, rows: list[int], logits: torch.Tensor, mb: Any) -> None:
        """The update's hook: the detached logits of a micro-batch's first pass."""
        self.add(rows, logits, mb.response_ids, mb.response_mask, self.temperature)

    def finish(self, data, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        from meshrl.diagnostics import mei_key, mei_metrics

        if self._phi is None:
            return {}, []
        prefix_ids = data.strategy_ids if self.mesh else None
        raw = mei_metrics(self._phi, data.query_ids, prefix_ids, feature=self.feature)
        self._phi = None
        metrics: dict[str, Any] = {k: v for k, v in raw.items() if not math.isnan(v)}
        q = raw[mei_key(self.feature, "query")]
        # Short aliases for plots and the acceptance contract; the feature map is named in the record.
        metrics.update({"mei/feature": self.feature, "mei/query": q,
                        # Effective directions: the participation ratio, a count in [1, G] (the report and the
                        # doctor use it); the paper's G/MEI exceeds G for anti-aligned rollouts and its mean is
                        # dominated by near-orthogonal groups (MEI ~ 0), so it is kept under its own name.
                        "mei/directions": raw[mei_key(self.feature, "query", "directions")],
                        "mei/directions_median": raw[mei_key(self.feature, "query", "directions_median")],
                        "mei/g_over_mei": raw[mei_key(self.feature, "query", "g_over_mei")],
                        "mei/g_over_mei_median": raw[mei_key(self.feature, "query", "g_over_mei_median")],
                        "mei/g_over_mei_of_mean": raw[mei_key(self.feature, "query", "g_over_mei_of_mean")]})
        if self.mesh:
            metrics["mei/prefix_group"] = raw[mei_key(self.feature, "prefix_group")]
        return metrics, self._warn(q, step)

    def _warn(self, mei: float, step: int) -> list[dict[str, Any]]:
        if self.threshold is None or math.isnan(mei):
            return []
        events = []
        if mei > self.threshold:
            self.above += 1
            if self.first_cross is None:
                self.first_cross = step
                events.append({"step": step, "event": "mei_first_crossing", "mei": mei, "threshold": self.threshold})
            if self.above >= self.patience and not self.warned:
                self.warned = True
                log.warning("step %d: MEI %.3f above threshold %.3f for %d checks (first crossing at step %d): "
                            "rollouts are collapsing onto fewer update directions", step, mei, self.threshold,
                            self.above, self.first_cross)
                events.append({"step": step, "event": "mei_warning", "mei": mei, "threshold": self.threshold,
                               "first_crossing_step": self.first_cross, "checks_above": self.above})
        else:
            self.above = 0
        return events

    def state_dict(self) -> dict[str, Any]:
        return {"above": self.above, "first_cross": self.first_cross, "warned": self.warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.above, self.first_cross, self.warned = state["above"], state["first_cross"], state["warned"]
