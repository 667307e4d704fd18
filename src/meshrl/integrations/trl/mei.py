"""``MEICallback``: the MEI monitor of meshrl's trainer for any TRL GRPO run.

MEI (``meshrl.diagnostics.mei``) of the ``bias`` feature map ``phi_i = sum_t m_t (e_{y_t} - softmax(z_t / T))``
per query (the ``num_generations`` completions of one dataset row) and, when the trainer carries
``strategy_ids`` (``MeshGRPOTrainer``), per prefix group; effective directions G / MEI; the warning when
the query MEI stays above a calibrated threshold (``meshrl mei calibrate``) for ``patience`` checks.

TRL 1.16 computes log-probs with a fused LM head and never materialises logits, and the bias map needs
the whole softmax, so the callback runs one extra no-grad forward of the generation batch every ``every``
generation batches, ``batch_size`` rows at a time (memory ``batch_size x completion length x vocab``).
It needs the batch, so it is attached to the trainer, which adds it as a callback too::

    MEICallback(threshold="threshold.json", on_warning="stop").attach(trainer)

Metric keys are those of meshrl's trainer: ``mei/bias/query``, ``mei/bias/query_directions``, ...,
the aliases ``mei/query``, ``mei/directions`` (effective directions, at most G), ``mei/g_over_mei`` (the paper's
G/MEI), ``mei/prefix_group``, plus ``mei/threshold``,
``mei/checks_above``. Events (first crossing, warning) go to ``OUTPUT_DIR/mei_events.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from meshrl.diagnostics import bias_features, mei_key, mei_metrics
from meshrl.integrations.trl.options import check_trl_version
from meshrl.trainer import load_threshold  # a number or a `meshrl mei calibrate` JSON, checked

log = logging.getLogger("meshrl")
ON_WARNING = ("log", "stop", "checkpoint", "checkpoint_and_stop")


class MEICallback(TrainerCallback):
    """MEI per query / prefix group, effective directions and the threshold warning for a ``GRPOTrainer``.

    Args:
        threshold: a number, a ``meshrl mei calibrate`` JSON path, or ``None`` (metrics only, no warning).
        every: compute MEI on every ``every``-th generation batch (1 = each).
        patience: warn when the query MEI is above the threshold on this many consecutive checks.
        on_warning: ``log``; ``stop`` (``control.should_training_stop``); ``checkpoint``
            (``control.should_save``); ``checkpoint_and_stop``.
        batch_size: rows per extra forward (``None``: ``per_device_train_batch_size``).
    """

    feature = "bias"

    def __init__(self, threshold: str | float | None = None, *, every: int = 1, patience: int = 3,
                 on_warning: str = "log", batch_size: int | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"MEICallback every must be an integer >= 1, got {every!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"MEICallback patience must be an integer >= 1, got {patience!r}")
        if on_warning not in ON_WARNING:
            raise ValueError(f"MEICallback on_warning={on_warning!r}; known: {', '.join(ON_WARNING)}")
        self.threshold_spec, self.every, self.patience, self.on_warning = threshold, every, patience, on_warning
        self.batch_size = batch_size
        self.threshold: float | None = None
        self.trainer = None
        self.checks = 0
        self.above, self.first_cross, self.warned, self._act = 0, None, False, False
        self.events: list[dict[str, Any]] = []
        self.last: dict[str, float] = {}

    # ---- wiring ---------------------------------------------------------------------------------------------
    def attach(self, trainer) -> MEICallback:
        """Feed the callback from ``trainer``'s generation batches and register it; returns ``self``."""
        check_trl_version()
        if self.trainer is not None:
            raise ValueError("this MEICallback is already attached to a trainer")
        if not hasattr(trainer, "_generate_and_score_completions") or not hasattr(trainer, "num_generations"):
            raise ValueError(f"MEICallback.attach needs a trl GRPOTrainer, got {type(trainer).__name__}")
        self.threshold = load_threshold(self.threshold_spec, self.feature, trainer.num_generations)
        self.trainer = trainer
        original = trainer._generate_and_score_completions

        def generate_and_score(inputs):  # the instance attribute shadows the class method TRL calls
            out = original(inputs)
            if trainer.model.training:
                self._on_batch(out)
            return out

        trainer._generate_and_score_completions = generate_and_score
        trainer.add_callback(self)
        return self

    # ---- per batch --------------------------------------------------------------------------------------------
    def _on_batch(self, out: dict[str, Any]) -> None:
        self.checks += 1
        if (self.checks - 1) % self.every:
            return
        trainer = self.trainer
        phi = trainer.accelerator.gather(self.features(out))
        # Gathered rows are process-major, as in TRL's own gathers: a query is num_generations consecutive rows.
        query_ids = torch.arange(phi.shape[0]) // trainer.num_generations
        prefix_ids = trainer.accelerator.gather(out["strategy_ids"]).cpu() if "strategy_ids" in out else None
        metrics = self.metrics(phi.cpu(), query_ids, prefix_ids)
        metrics |= self._warn(metrics["mei/query"], trainer.state.global_step)
        self.last = metrics
        for key, value in metrics.items():
            if not math.isnan(value):
                trainer._metrics["train"][key].append(value)

    def features(self, out: dict[str, Any]) -> torch.Tensor:
        """``[B, V]`` bias features of the local completions (prompt tokens, padding and tool tokens masked)."""
        trainer = self.trainer
        prompt_ids, prompt_mask = out["prompt_ids"], out["prompt_mask"]
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
        mask = completion_mask if "tool_mask" not in out else completion_mask * out["tool_mask"]
        size = self.batch_size or trainer.args.per_device_train_batch_size
        width = completion_ids.size(1)
        rows = []
        with torch.no_grad():
            for s in range(0, completion_ids.size(0), size):
                ids = torch.cat([prompt_ids[s:s + size], completion_ids[s:s + size]], 1)
                att = torch.cat([prompt_mask[s:s + size], completion_mask[s:s + size]], 1)
                logits = trainer.model(input_ids=ids, attention_mask=att, logits_to_keep=width + 1).logits[:, :-1]
                rows.append(bias_features(logits, completion_ids[s:s + size], mask[s:s + size],
                                          temperature=trainer.temperature if trainer.temperature > 0 else 1.0))
        return torch.cat(rows).float()

    def metrics(self, phi: torch.Tensor, query_ids, prefix_ids=None) -> dict[str, float]:
        """meshrl's MEI metrics of one batch (:func:`meshrl.diagnostics.mei_metrics`) plus the short aliases."""
        raw = mei_metrics(phi, query_ids, prefix_ids, feature=self.feature)
        out = dict(raw)
        out["mei/query"] = raw[mei_key(self.feature, "query")]
        out["mei/directions"] = raw[mei_key(self.feature, "query", "directions")]
        out["mei/g_over_mei"] = raw[mei_key(self.feature, "query", "g_over_mei")]
        if prefix_ids is not None:
            out["mei/prefix_group"] = raw[mei_key(self.feature, "prefix_group")]
        return out

    def _warn(self, mei: float, step: int) -> dict[str, float]:
        if self.threshold is None:
            return {}
        if not math.isnan(mei) and mei > self.threshold:
            self.above += 1
            if self.first_cross is None:
                self.first_cross = step
                self._event({"step": step, "event": "mei_first_crossing", "mei": mei, "threshold": self.threshold})
            if self.above >= self.patience and not self.warned:
                self.warned = self._act = True
                log.warning("step %d: MEI %.3f above threshold %.3f for %d checks (first crossing at step %d): "
                            "rollouts are collapsing onto fewer update directions", step, mei, self.threshold,
                            self.above, self.first_cross)
                self._event({"step": step, "event": "mei_warning", "mei": mei, "threshold": self.threshold,
                             "first_crossing_step": self.first_cross, "checks_above": self.above,
                             "action": self.on_warning})
        elif not math.isnan(mei):
            self.above = 0
        return {"mei/threshold": self.threshold, "mei/checks_above": float(self.above)}

    def _event(self, record: dict[str, Any]) -> None:
        self.events.append(record)
        trainer = self.trainer
        if trainer is not None and trainer.accelerator.is_main_process and trainer.args.output_dir:
            path = Path(trainer.args.output_dir) / "mei_events.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    # ---- TrainerCallback ------------------------------------------------------------------------------------
    def on_step_end(self, args, state, control, **kwargs):
        if self._act:
            self._act = False
            if self.on_warning in ("checkpoint", "checkpoint_and_stop"):
                control.should_save = True
            if self.on_warning in ("stop", "checkpoint_and_stop"):
                control.should_training_stop = True
        return control
