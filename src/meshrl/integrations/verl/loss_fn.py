"""The meshrl actor loss for verl: verl's PPO loss plus strategy balancing and a sampled JS penalty.

verl's actor calls ``loss_fn(model_output, data, dp_group=None) -> (loss, metrics)`` once per micro-batch
(``verl/workers/engine/fsdp/transformer_impl.py``, 0.9.1) and backpropagates the returned loss directly; the
default is ``partial(ppo_loss, config=actor_config)``, replaced through the worker group's ``set_loss_fn``.
Unlike a registered policy loss, which only receives the padded log-probs, advantages and mask, this function
sees the whole micro-batch ``data``: the per-sample fields the meshrl trainer wrote (balancing weights, ids) and
``ref_log_prob``.

Strategy balancing (:mod:`meshrl.mesh.balance`) needs all rollouts of a query at once, while verl shuffles rows
into mini-batches and splits those into micro-batches. So, as meshrl's own trainer does, the trainer computes
per-rollout coefficients ``w_j = dJ/d seq_logp_j`` once per step from the step's old (sampling-policy) log-probs
(:func:`meshrl.mesh.strategy_balance_row_weights`) and stores them as the field ``meshrl_balance_weight``; here each
micro-batch adds the surrogate ``dp_size * sum_j w_j * seq_logp_j`` (``seq_logp_j`` = sum of the row's response
log-probs under the current policy). FSDP averages gradients over data-parallel ranks, hence ``dp_size``; summed
over micro-batches and ranks its gradient is ``sum_j w_j grad seq_logp_j``, the balancing gradient of the rows of
the mini-batch, at the step's start parameters exactly.

The JS penalty is ``js_coef * agg_loss(js_sampled(log_prob, ref_log_prob))`` with verl's aggregation (the value is
an unbiased estimate of JS(pi, pi_ref) >= 0 and its gradient the score-function estimator of grad JS; see
:func:`meshrl.algos.js_sampled`). The exact JS over the vocabulary would need the reference *logits*, which verl's
reference worker never computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from meshrl.algos import js_sampled
from meshrl.integrations.verl.mei import next_tokens, sketch_fields, token_bias_sketch
from meshrl.integrations.verl.settings import BALANCE_WEIGHT, MeshSettings


def _field(data: Any, name: str, why: str) -> Any:
    if name not in data:
        raise ValueError(f"verl micro-batch has no field {name!r} ({why})")
    return data[name]


def _padded(data: Any, name: str, why: str) -> torch.Tensor:
    value = _field(data, name, why)
    return value.to_padded_tensor(0.0) if getattr(value, "is_nested", False) else value


def balance_surrogate(log_prob: torch.Tensor, response_mask: torch.Tensor, weights: torch.Tensor,
                      dp_size: int) -> torch.Tensor:
    """``dp_size * sum_j w_j * sum_t m_jt log_prob_jt``: the micro-batch's share of the balancing term.

    Args:
        log_prob: ``[B, T]`` padded response log-probs under the current policy (with grad).
        response_mask: ``[B, T]`` 0/1 (or bool) response mask.
        weights: ``[B]`` detached coefficients ``dJ/d seq_logp`` from the trainer.
        dp_size: data-parallel world size (FSDP averages gradients over it).
    """
    if weights.dim() != 1 or weights.shape[0] != log_prob.shape[0]:
        raise ValueError(f"{BALANCE_WEIGHT} must have shape [{log_prob.shape[0]}], got {tuple(weights.shape)}")
    seq_logp = (log_prob * response_mask.to(log_prob.dtype)).sum(-1)
    return float(dp_size) * (weights.detach().to(seq_logp.dtype) * seq_logp).sum()


def _metric_aggregation(data: Any, config: Any) -> AggregationType:
    """How verl must combine a loss term's per-micro-batch metric, by ``ppo_loss``'s own rule: once any global
    batch figure is set (the FSDP engine always sets ``batch_num_tokens``), each micro-batch's term is its
    share of the global mean, so the shares add up (SUM); without them each is a local mean (MEAN)."""
    shares = (_non_tensor(data, "dp_size", 1) > 1 or _non_tensor(data, "batch_num_tokens") is not None
              or _non_tensor(data, "global_batch_size") is not None
              or getattr(config, "loss_scale_factor", None) is not None)
    return AggregationType.SUM if shares else AggregationType.MEAN


def _non_tensor(data: Any, key: str, default: Any = None) -> Any:
    return data[key] if key in data else default  # noqa: SIM401 - TensorDict.get wraps non-tensor values


def mei_sketch_outputs(student_logits: torch.Tensor, data: Any, mesh: MeshSettings) -> dict[str, torch.Tensor]:
    """The logits-processor answer: one ``[1, nnz]`` per-token field per sketch bucket (see
    :mod:`meshrl.integrations.verl.mei`); the engine stores them as model outputs of the old-log-prob pass."""
    if mesh.mei_sketch == 0:
        raise ValueError("the engine asked meshrl's loss for logit outputs (distillation_use_topk) but "
                         "meshrl.mei_sketch is 0; top-k distillation cannot be combined with the meshrl trainer mode")
    logits = student_logits.squeeze(0)
    ids = _field(data, "input_ids", "the next tokens of the MEI sketch")
    labels = next_tokens(ids.values() if getattr(ids, "is_nested", False) else ids.reshape(-1), logits.shape[0])
    sketch = token_bias_sketch(logits, labels.to(logits.device), mesh.mei_sketch, mesh.mei_seed)
    return {name: sketch[:, i].unsqueeze(0) for i, name in enumerate(sketch_fields(mesh.mei_sketch))}


def mesh_loss(
    model_output: dict | None = None,
    data: Any = None,
    dp_group: Any = None,
    *,
    config: Any,
    mesh: MeshSettings,
    base_loss: Callable[..., tuple[torch.Tensor, dict]] = ppo_loss,
    student_logits: torch.Tensor | None = None,
) -> Any:
    """verl's ``base_loss`` (``ppo_loss``) plus the balancing surrogate and the JS penalty of one micro-batch.

    Two more calls come from the engine in the old-log-prob pass when ``meshrl.mei_sketch > 0`` (the trainer
    sets ``compute_loss`` and ``distillation_use_topk`` there): ``loss_fn(student_logits=..., data=...)`` returns
    the MEI sketch fields (:func:`mei_sketch_outputs`), and the loss call of that forward-only pass (a batch
    without ``advantages``) returns a zero loss.

    Missing fields raise ``ValueError`` naming them: ``meshrl_balance_weight`` when ``mesh.mu > 0`` (written by the
    ``meshrl`` trainer mode), ``ref_log_prob`` when ``mesh.js_coef > 0`` (computed by verl when
    ``actor_rollout_ref.actor.use_kl_loss=true``; set ``kl_loss_coef=0`` to keep only the JS term).
    Metrics ``meshrl/balance_surrogate`` and ``meshrl/js`` (verl prefixes ``actor/``).
    """
    if student_logits is not None:
        return mei_sketch_outputs(student_logits, data, mesh)
    if mesh.mei_sketch and "advantages" not in data:
        return torch.zeros((), device=model_output["log_probs"].device), {}
    loss, metrics = base_loss(config, model_output, data, dp_group)
    if mesh.mu == 0 and mesh.js_coef == 0:
        return loss, metrics
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    mask = _padded(data, "response_mask", "verl's response mask").to(log_prob.dtype)
    dp_size = int(data["dp_size"]) if "dp_size" in data else 1
    agg = _metric_aggregation(data, config)
    if mesh.mu > 0:
        weights = _field(data, BALANCE_WEIGHT, "strategy balancing is on (meshrl.mu > 0): run verl with "
                         "trainer.v1.trainer_mode=meshrl, which writes it")
        term = balance_surrogate(log_prob, mask, weights, dp_size)
        loss = loss + term
        metrics["meshrl/balance_surrogate"] = Metric(value=term.detach(), aggregation=AggregationType.SUM)
    if mesh.js_coef > 0:
        ref = _padded(data, "ref_log_prob", "meshrl.js_coef > 0 needs reference log-probs: set "
                      "actor_rollout_ref.actor.use_kl_loss=true (kl_loss_coef=0 keeps only the JS term)")
        js = agg_loss(loss_mat=js_sampled(log_prob, ref.to(log_prob.dtype)), loss_mask=mask.bool(),
                      loss_agg_mode=config.loss_agg_mode, **config.global_batch_info)
        loss = loss + mesh.js_coef * js
        metrics["meshrl/js"] = Metric(value=js.detach(), aggregation=agg)
    return loss, metrics
