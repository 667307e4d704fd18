"""MEI of a verl step from count-sketched ``bias`` features of the old-log-prob pass (no verl import).

MEI's ``bias`` feature of a rollout is ``phi_i = sum_t m_t (e_{y_t} - softmax(z_t / T))`` in R^V
(:func:`meshrl.diagnostics.bias_features`). verl's actor never hands the logits to a loss function, except through
the FSDP engine's logits-processor hook (``prepare_model_outputs(..., logits_processor_func)``, used for top-k
distillation): with ``distillation_use_topk`` set in a micro-batch, the engine calls the loss function as
``loss_fn(student_logits=[1, nnz, V] temperature-scaled logits, data=micro_batch)`` and stores every returned
``[1, nnz]`` tensor as a per-token model output. The meshrl loss answers that call with the count sketch
(:func:`meshrl.diagnostics.count_sketch`, ``k`` buckets, seeded) of each token's ``e_{y_t} - p_t``, one field per
bucket; the sketch is linear, so the trainer's per-rollout sums over response tokens are exactly the count sketch
of ``phi_i``, and the Gram matrix of the sketches is an unbiased estimate of the exact one. MEI is then
:func:`meshrl.diagnostics.mei_metrics` per query and per (query, prefix) group, under the feature name
``bias_sketch<k>``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from meshrl.diagnostics import count_sketch, mei_metrics

FIELD = "meshrl_mei_sketch_{}"
CHUNK = 256  # token rows per count-sketch call: CHUNK x V float64 transient memory


def sketch_fields(k: int) -> list[str]:
    """Names of the ``k`` per-token model-output fields, one per sketch bucket."""
    return [FIELD.format(i) for i in range(k)]


def token_bias_sketch(logits: torch.Tensor, labels: torch.Tensor, k: int, seed: int = 0,
                      chunk: int = CHUNK) -> torch.Tensor:
    """``[N, k]`` float32 count sketch of ``e_{labels_n} - softmax(logits_n)`` for each of ``N`` token rows.

    ``logits`` ``[N, V]`` are already divided by the sampling temperature (as the engine passes them);
    ``labels`` ``[N]`` are the next tokens (any id for rows that are not response positions: they are masked out
    later). No gradient flows.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V] and labels [N], got {tuple(logits.shape)} / {tuple(labels.shape)}")
    out = torch.empty(logits.shape[0], k, dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for s in range(0, logits.shape[0], chunk):
            rows = -torch.softmax(logits[s : s + chunk].double(), dim=-1)
            rows[torch.arange(rows.shape[0], device=rows.device), labels[s : s + chunk].long()] += 1.0
            out[s : s + chunk] = count_sketch(rows, k, seed).float()
    return out


def next_tokens(input_ids_values: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Labels of a packed sequence: token ``p + 1`` for position ``p``, cut or zero-padded to ``n_rows``."""
    labels = torch.roll(input_ids_values, shifts=-1)
    if labels.shape[0] >= n_rows:
        return labels[:n_rows]
    return torch.cat([labels, labels.new_zeros(n_rows - labels.shape[0])])


def step_mei(row_sketch: torch.Tensor, query_ids: Sequence[Hashable], strategy_ids: Sequence[Hashable],
             padding: Sequence[bool]) -> dict[str, float]:
    """``mei/bias_sketch<k>/{query,prefix_group}[_stat]`` of one step from ``[B, k]`` per-rollout sketches."""
    keep = [j for j, pad in enumerate(padding) if not pad]
    if not keep:
        return {}
    phi = row_sketch[keep].double()
    return mei_metrics(phi, [query_ids[j] for j in keep], [strategy_ids[j] for j in keep],
                       feature=f"bias_sketch{row_sketch.shape[1]}")
