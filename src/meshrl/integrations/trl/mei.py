"""``MEICallback``: the MEI monitor of meshrl's trainer for any TRL GRPO run.

MEI (``meshrl.diagnostics.mei``) of the ``bias`` feature map ``phi_i = sum_t m_t (e_{y_t} - softmax(z_t / T))``
per query (the ``num_generations`` completions of one dataset row) and, when the trainer carries
``strategy_ids`` (``MeshGRPOTrainer``), per prefix group; effective directions G / MEI; the warning when
the query MEI stays above a calibrated threshold (``meshrl mei calibrate``) for ``patience`` checks.

TRL 1.16 computes log-probs with a fused LM head and never materialises logits, and the bias map needs
the whole softmax. The callback therefore reads the LM head's *input* from TRL's own forward
(:mod:`meshrl.integrations.trl.head_capture`: a hook on the backbone, the completion positions' hidden states)
and projects only the completion tokens through the head, every ``every`` generation batches:

- from the no-grad forward over the whole generation batch that TRL (old log-probs, when importance sampling
  needs them) or ``MeshGRPOTrainer`` (the balancing weights' log-probs) runs while generating: the metrics come
  with the batch;
- otherwise from the loss forward of each micro-batch, on its first pass (the weights are those of generation:
  without old log-probs, TRL runs all micro-batches of a generation batch within one optimiser step); the
  metrics come with the batch's last micro-batch, before that step's log.

Where the head's input cannot be read (DeepSpeed / FSDP, vision-language models, logits that the model rescales or
soft-caps; logged once), it runs its own no-grad forward of the generation batch, ``batch_size`` rows at a time
(memory ``batch_size x completion length x vocab``), as it also does for a micro-batch whose forward did not show
the expected hidden states. It needs the batch, so it is attached to the trainer, which adds it as a callback too::

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
from accelerate.utils import is_peft_model
from transformers import TrainerCallback

from meshrl.diagnostics import bias_features, mei_key, mei_metrics
from meshrl.integrations.trl.head_capture import HeadUnsupported, HiddenCapture, Recording
from meshrl.integrations.trl.options import check_trl_version
from meshrl.trainer import load_threshold  # a number or a `meshrl mei calibrate` JSON, checked

log = logging.getLogger("meshrl")
ON_WARNING = ("log", "stop", "checkpoint", "checkpoint_and_stop")
ROWS_KEY = "mei_rows"  # each row's index in its generation batch; TRL's shuffle and split carry it to the loss


def _model_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """The completion tokens the policy wrote: padding and, in tool-using runs, tool output masked out."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


class GenerationForward:
    """The first no-grad policy forward inside one generation call, as recorded by :class:`HiddenCapture`."""

    def __init__(self) -> None:
        self.record: Recording | None = None
        self.input_ids: torch.Tensor | None = None
        self.attention_mask: torch.Tensor | None = None

    def features(self, callback: MEICallback, out: dict[str, Any]) -> torch.Tensor | None:
        """The batch's features, or ``None`` unless the forward scored exactly ``out``'s sequences."""
        hidden = self.record.hidden() if self.record is not None else None
        if hidden is None:
            return None
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        if not (torch.equal(self.input_ids, ids) and torch.equal(self.attention_mask, att)):
            return None  # another forward of the call (MeshGRPOTrainer's bare prompts): the loss is read instead
        return callback.capture.features(hidden, out["completion_ids"], _model_tokens(out), callback._temperature())


class PendingBatch:
    """Features of one generation batch filled micro-batch by micro-batch from the loss forwards."""

    def __init__(self, out: dict[str, Any], rows: int) -> None:
        self.out = out
        self.filled = torch.zeros(rows, dtype=torch.bool)
        self.phi: torch.Tensor | None = None

    def add(self, rows: torch.Tensor, phi: torch.Tensor) -> bool:
        """Store the rows' features; ``True`` once every row of the batch has them."""
        if self.phi is None:
            self.phi = phi.new_zeros(self.filled.numel(), phi.shape[1])
        self.phi[rows.to(self.phi.device)] = phi
        self.filled[rows.cpu()] = True
        return bool(self.filled.all())


class MEICallback(TrainerCallback):
    """MEI per query / prefix group, effective directions and the threshold warning for a ``GRPOTrainer``.

    Args:
        threshold: a number, a ``meshrl mei calibrate`` JSON path, or ``None`` (metrics only, no warning).
        every: compute MEI on every ``every``-th generation batch (1 = each).
        patience: warn when the query MEI is above the threshold on this many consecutive checks.
        on_warning: ``log``; ``stop`` (``control.should_training_stop``); ``checkpoint``
            (``control.should_save``); ``checkpoint_and_stop``.
        batch_size: rows per forward of the fallback (``None``: ``per_device_train_batch_size``).
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
        self.capture: HiddenCapture | None = None  # None: the fallback, an own forward per checked batch
        self._generation: GenerationForward | None = None
        self._pending: PendingBatch | None = None
        self._notes: set[str] = set()

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
        try:
            self.capture = HiddenCapture(trainer)
        except HeadUnsupported as e:
            self._note(f"MEICallback: {e}; MEI runs its own no-grad forward of each checked generation batch")
        # Instance attributes shadow the class methods TRL calls (self._generate_and_score_completions, ...).
        generate = trainer._generate_and_score_completions

        def generate_and_score(inputs):
            due = trainer.model.training and self._due()
            self._generation = GenerationForward() if due and self._generation_forward_usable() else None
            try:
                out = generate(inputs)
                generation, self._generation = self._generation, None
            finally:
                self._generation = None
            if due:
                self._on_batch(out, generation)
            return out

        trainer._generate_and_score_completions = generate_and_score
        if self.capture is not None:
            self._wrap_forwards(trainer)
        trainer.add_callback(self)
        return self

    def _wrap_forwards(self, trainer) -> None:
        per_token_logps, compute_loss = trainer._get_per_token_logps_and_entropies, trainer._compute_loss

        def logps_recorded(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            gen = self._generation
            if gen is None or gen.record is not None or torch.is_grad_enabled() or not self.capture.is_policy(model):
                return per_token_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            gen.input_ids, gen.attention_mask = input_ids, attention_mask
            with self.capture.recording(input_ids.size(0), input_ids.size(1), logits_to_keep) as gen.record:
                return per_token_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

        def loss_recorded(model, inputs):
            pending, rows = self._pending, inputs.get(ROWS_KEY)
            if pending is None or rows is None or not trainer.model.training or pending.filled[rows.cpu()].all():
                return compute_loss(model, inputs)
            ids = inputs["completion_ids"]
            with self.capture.recording(ids.size(0), inputs["prompt_ids"].size(1) + ids.size(1), ids.size(1)) as rec:
                loss = compute_loss(model, inputs)
            hidden = rec.hidden()
            if hidden is None:
                self._note(f"MEICallback: a loss forward did not show the LM head's input ({rec.error or 'rows'}); "
                           "such micro-batches get their own no-grad forward")
                phi = self.features(inputs)
            else:
                phi = self.capture.features(hidden, ids, _model_tokens(inputs), self._temperature())
            if pending.add(rows, phi):
                self._pending = None
                self._publish(pending.phi, pending.out)
            return loss

        trainer._get_per_token_logps_and_entropies = logps_recorded
        trainer._compute_loss = loss_recorded

    def _generation_forward_usable(self) -> bool:
        """Whether the first policy forward of a generation call scores the batch under the policy's weights.

        TRL computes old log-probs (first) when ``gradient_accumulation_steps`` is not a multiple of
        ``steps_per_generation x num_iterations`` or vLLM importance sampling is on; otherwise, with a PEFT
        adapter and ``beta != 0``, its first policy forward is the reference (adapter off), which must not count.
        """
        trainer = self.trainer
        if self.capture is None:
            return False
        every = trainer.args.steps_per_generation * trainer.num_iterations
        old = trainer.args.gradient_accumulation_steps % every != 0 or (
            trainer.use_vllm and trainer.vllm_importance_sampling_correction)
        return old or trainer.beta == 0.0 or not is_peft_model(trainer.accelerator.unwrap_model(trainer.model))

    # ---- per batch --------------------------------------------------------------------------------------------
    def _due(self) -> bool:
        self.checks += 1
        return (self.checks - 1) % self.every == 0

    def _on_batch(self, out: dict[str, Any], generation: GenerationForward | None) -> None:
        if self.capture is None:
            self._publish(self.features(out), out)
            return
        phi = generation.features(self, out) if generation is not None else None
        if phi is not None:
            self._publish(phi, out)
            return
        if self._pending is not None:
            self._note("MEICallback: a generation batch was replaced before all its rows passed through the loss; "
                       "its MEI is skipped")
        rows = out["completion_ids"].size(0)
        out[ROWS_KEY] = torch.arange(rows, device=out["completion_ids"].device)
        self._pending = PendingBatch(out, rows)

    def _publish(self, local_phi: torch.Tensor, out: dict[str, Any]) -> None:
        trainer = self.trainer
        phi = trainer.accelerator.gather(local_phi)
        # Gathered rows are process-major, as in TRL's own gathers: a query is num_generations consecutive rows.
        query_ids = torch.arange(phi.shape[0]) // trainer.num_generations
        prefix_ids = trainer.accelerator.gather(out["strategy_ids"]).cpu() if "strategy_ids" in out else None
        metrics = self.metrics(phi.cpu(), query_ids, prefix_ids)
        metrics |= self._warn(metrics["mei/query"], trainer.state.global_step)
        self.last = metrics
        for key, value in metrics.items():
            if not math.isnan(value):
                trainer._metrics["train"][key].append(value)

    def _temperature(self) -> float:
        return self.trainer.temperature if self.trainer.temperature > 0 else 1.0

    def _note(self, message: str) -> None:
        if message not in self._notes:
            self._notes.add(message)
            log.info(message)

    def features(self, out: dict[str, Any]) -> torch.Tensor:
        """``[B, V]`` bias features of the local completions (prompt tokens, padding and tool tokens masked) from
        the callback's own no-grad forward (the fallback where the LM head's input cannot be recorded)."""
        trainer = self.trainer
        prompt_ids, prompt_mask = out["prompt_ids"], out["prompt_mask"]
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
        mask = _model_tokens(out)
        size = self.batch_size or trainer.args.per_device_train_batch_size
        width = completion_ids.size(1)
        rows = []
        with torch.no_grad():
            for s in range(0, completion_ids.size(0), size):
                ids = torch.cat([prompt_ids[s:s + size], completion_ids[s:s + size]], 1)
                att = torch.cat([prompt_mask[s:s + size], completion_mask[s:s + size]], 1)
                logits = trainer.model(input_ids=ids, attention_mask=att, logits_to_keep=width + 1).logits[:, :-1]
                rows.append(bias_features(logits, completion_ids[s:s + size], mask[s:s + size],
                                          temperature=self._temperature()))
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
