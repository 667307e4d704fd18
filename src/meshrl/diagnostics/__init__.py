"""Pure diagnostics of strategy collapse: MEI feature maps, Fisher scores, coupling kernel, strategies.

Layer 2: imports torch, numpy and ``meshrl.algos`` only; no trainer state. Every function documents
its formula (docs/method.md §1.1, §1.2), its source and its tensor shapes; bad inputs raise ``ValueError``
naming the argument.

- :mod:`~meshrl.diagnostics.features`: ``bias_features`` (``[B, V]``, from logits, or ``bias_features_from_hidden``
  from final hidden states and the unembedding) and ``head_gram`` (``[B, B]``,
  exact kernel trick or TensorSketch) from aligned logits / tokens / hidden states.
- :mod:`~meshrl.diagnostics.fisher`: ``fisher_scores`` (``[B, P]`` exact per-rollout scores of a
  causal LM, or their count sketch), the ``full`` feature map and the input of the coupling kernel.
- :mod:`~meshrl.diagnostics.mei`: ``mei_from_gram``, ``group_mei`` (any grouping) and ``mei_metrics``
  (keys ``mei/<feature>/<scope>[_<stat>]``).
- :mod:`~meshrl.diagnostics.kernel`: ``coupling_kernel``, ``kernel_distance``, ``epsilon_partition``,
  ``strategy_masses``.
"""

from meshrl.diagnostics.features import bias_features, bias_features_from_hidden, head_gram
from meshrl.diagnostics.fisher import count_sketch, fisher_scores
from meshrl.diagnostics.kernel import (
    coupling_kernel,
    epsilon_partition,
    kernel_distance,
    normalise_kernel,
    strategy_masses,
)
from meshrl.diagnostics.mei import (
    FEATURE_MAPS,
    SCOPES,
    STATS,
    gram_matrix,
    group_mei,
    mean_pairwise_cosine,
    mei_from_gram,
    mei_key,
    mei_metrics,
    participation_ratio,
)

__all__ = [
    "FEATURE_MAPS",
    "SCOPES",
    "STATS",
    "bias_features",
    "bias_features_from_hidden",
    "count_sketch",
    "coupling_kernel",
    "epsilon_partition",
    "fisher_scores",
    "gram_matrix",
    "group_mei",
    "head_gram",
    "kernel_distance",
    "normalise_kernel",
    "mean_pairwise_cosine",
    "mei_from_gram",
    "mei_key",
    "mei_metrics",
    "participation_ratio",
    "strategy_masses",
]
