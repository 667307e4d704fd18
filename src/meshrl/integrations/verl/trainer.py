"""``trainer.v1.trainer_mode=meshrl``: verl's synchronous v1 trainer with meshrl's loss wrapper and balancing step.

Registered with verl's ``register_trainer`` (``verl/trainer/ppo/v1/trainer_base.py``, 0.9.1) when the plugin loads,
so ``TaskRunnerV1`` finds it by name inside its Ray actor. It subclasses ``PPOTrainerSync`` (colocated rollout and
training, weight sync after each step) and changes two stages:

- ``init`` checks the ``meshrl`` settings against verl's before any worker starts; ``on_init_end``, after the
  workers exist, installs :func:`meshrl.integrations.verl.loss_fn.mesh_loss` on the actor
  through ``set_loss_fn`` (the default, ``partial(ppo_loss, ...)``, is set inside ``init_model``, so it must come
  after), and checks that verl computes the reference log-probs when meshrl's terms need them.
- ``_compute_old_log_prob`` (with ``meshrl.mei_sketch > 0``): asks the engine for the count-sketched ``bias``
  features through its logits-processor hook during verl's own old-log-prob forward (no extra forward), sums them
  over each rollout's response tokens and logs MEI per query and per prefix group
  (:mod:`meshrl.integrations.verl.mei`); a pass that returns no sketch is logged and counted
  (``mei/skipped_steps``), not fatal.
- ``_compute_metrics`` (with ``meshrl.health_every > 0``): after verl's own metrics, meshrl doctor's checks on the
  run's metrics so far (:mod:`meshrl.integrations.verl.health`): findings to ``health_events.jsonl`` and
  ``health/*`` figures into the step's metrics; ``stop`` ends the loop after the step.
- ``_compute_advantage``: after verl's own advantages, reads each row's ``extra_info`` ids, scores and log-probs
  from TransferQueue, computes the balancing weights once for the step
  (:func:`meshrl.integrations.verl.balance_step.balance_fields`) and writes them back as per-row fields that the
  actor's micro-batches carry; logs ``mesh/*`` metrics with meshrl's own names.

Not run end to end here: a verl trainer needs a GPU and a rollout server (vLLM/SGLang). The pieces are unit-tested
on CPU (``tests/verl_engine``).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.padding import response_from_nested

from meshrl.integrations.verl.balance_step import as_row_list, balance_fields, row_ids
from meshrl.integrations.verl.health import VerlHealth
from meshrl.integrations.verl.loss_fn import mesh_loss
from meshrl.integrations.verl.mei import sketch_fields, step_mei
from meshrl.integrations.verl.settings import MeshSettings, settings_from_config

TRAINER_MODE = "meshrl"
log = logging.getLogger(__name__)


def mesh_settings_of(config: Any) -> MeshSettings:
    """The run's :class:`MeshSettings` from verl's config (its ``meshrl`` block), checked against verl's settings."""
    block = config.get("meshrl") if hasattr(config, "get") else None
    if block is not None and hasattr(block, "items"):
        block = {str(k): v for k, v in block.items()}
    mesh = settings_from_config(block)
    actor = config.actor_rollout_ref.actor
    if mesh.mei_sketch:
        fsdp = actor.get("fsdp_config") or {}
        sp = max(int(actor.get("ulysses_sequence_parallel_size") or 1),
                 int(fsdp.get("ulysses_sequence_parallel_size") or 1))
        if sp != 1 or actor.get("use_fused_kernels", False) or config.actor_rollout_ref.model.get("use_fused_kernels"):
            raise ValueError("meshrl.mei_sketch needs the engine's logits: set "
                             "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 and no fused kernels, "
                             "or meshrl.mei_sketch=0")
    if mesh.mu > 0 and config.data.get("shuffle", True):
        raise ValueError("meshrl.mu > 0 needs data.shuffle=false: the exported rows are query-major, so with "
                         "data.train_batch_size a multiple of m every query's m prefix rows land in one step")
    if mesh.needs_reference and not (actor.get("use_kl_loss", False) or config.algorithm.get("use_kl_in_reward")):
        raise ValueError("meshrl.js_coef > 0 or meshrl.subtract_ref=true needs verl's reference log-probs: set "
                         "actor_rollout_ref.actor.use_kl_loss=true (with kl_loss_coef=0 it adds no KL term)")
    return mesh


def mesh_loss_for(config: Any, mesh: MeshSettings) -> partial:
    """The actor loss function to install with ``set_loss_fn``: ``mesh_loss`` bound to the actor config."""
    return partial(mesh_loss, config=omega_conf_to_dataclass(config.actor_rollout_ref.actor), mesh=mesh)


@register_trainer(TRAINER_MODE)
class MeshPPOTrainer(PPOTrainerSync):
    """verl's sync PPO/GRPO trainer plus Mesh Learning's strategy balancing and sampled-JS term."""

    def init(self) -> None:
        self.mesh = mesh_settings_of(self.config)  # bad settings fail here, before any worker starts
        super().init()

    def on_init_end(self) -> None:
        super().on_init_end()
        self.actor_rollout_wg.set_loss_fn(mesh_loss_for(self.config, self.mesh))

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        if not self.mesh.mei_sketch:
            return super()._compute_old_log_prob(batch, metrics)
        group = self.actor_rollout_wg
        plain = group.compute_log_prob

        def with_sketch(b: Any) -> Any:  # verl sets compute_loss=False just before this call
            b.extra_info.update({"compute_loss": True, "distillation_use_topk": True})
            try:
                return plain(b)
            finally:
                b.extra_info.update({"compute_loss": False, "distillation_use_topk": False})

        group.compute_log_prob = with_sketch
        try:
            batch = super()._compute_old_log_prob(batch, metrics)
        finally:
            group.compute_log_prob = plain
        metrics.update(self._step_mei(batch))
        return batch

    def _step_mei(self, batch: Any) -> dict[str, float]:
        names = sketch_fields(self.mesh.mei_sketch)
        try:
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                   select_fields=[*names, "response_mask", "extra_info"])
        except Exception as e:  # TransferQueue raises its own error types for a missing field
            self._mei_skips = getattr(self, "_mei_skips", 0) + 1
            log.warning("meshrl: no MEI sketch in this step's batch (%s); skipped %d step(s)", e, self._mei_skips)
            return {"mei/skipped_steps": float(self._mei_skips)}
        nested_mask = data["response_mask"]
        mask = nested_mask.to_padded_tensor(0).to(torch.float32)
        sketch = torch.stack([(response_from_nested(data[f], nested_mask).to_padded_tensor(0.0) * mask).sum(-1)
                              for f in names], dim=-1)
        padding = [bool(tag.get("is_padding", False)) for tag in batch.tags]
        queries, strategies = row_ids(as_row_list(data["extra_info"], len(batch), "extra_info"), padding)
        self._shrink_sketch(batch, names, sketch)
        return step_mei(sketch, queries, strategies, padding)

    @staticmethod
    def _shrink_sketch(batch: Any, names: list[str], sketch: torch.Tensor) -> None:
        """Overwrite the per-token sketch fields with their per-rollout sums: the actor update fetches every stored
        field of its rows, and k per-token fields would multiply that transfer."""
        small = TensorDict({name: sketch[:, i].contiguous() for i, name in enumerate(names)}, batch_size=len(batch))
        try:
            tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=small)
        except Exception as e:  # a storage that refuses a new shape keeps the per-token fields: slower, not wrong
            log.warning("meshrl: could not shrink the MEI sketch fields (%s)", e)

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        if not self.mesh.health_every:
            return
        if getattr(self, "_health", None) is None:
            out = self.mesh.health_dir or self.config.trainer.default_local_dir
            dumps = self.mesh.health_samples_dir or getattr(self.config.trainer, "rollout_data_dir", None)
            self._health = VerlHealth(self.mesh.health_every, dict(self.mesh.health_on), out, dumps)
        figures, action, reason = self._health.after_step(int(global_steps), metrics)
        metrics.update(figures)
        if action == "checkpoint":
            self._save_checkpoint()
        elif action == "stop":  # the loop ends after this step: global_steps + 1 > total_training_steps
            log.warning("meshrl: %s", reason)
            self.total_training_steps = int(global_steps)

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        batch = super()._compute_advantage(batch, metrics)
        if self.mesh.mu == 0:
            return batch
        fields = ["extra_info", "rm_scores", "response_mask", "old_log_probs"]
        if self.mesh.subtract_ref:
            fields.append("ref_log_prob")
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        n = len(batch)
        extra = as_row_list(data["extra_info"], n, "extra_info")
        tensors = data.select(*[f for f in fields if f != "extra_info"]).to_padded_tensor()
        padding = [bool(tag.get("is_padding", False)) for tag in batch.tags]
        out, step_metrics = balance_fields(
            extra, tensors["rm_scores"], tensors["response_mask"], tensors["old_log_probs"],
            tensors.get("ref_log_prob", None), self.mesh, padding,
        )
        metrics.update(step_metrics)
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                               fields=TensorDict(out, batch_size=n))
