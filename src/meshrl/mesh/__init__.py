"""Mesh Learning (docs/method.md §1.3): Strategy-Balancing Regularisation and Coach Prompting.

Layer 2: imports torch, numpy, the standard library and :mod:`meshrl.algos` only; it works on the
tensors, ids and queries it is handed.

- :func:`strategy_balance_loss` / :func:`strategy_balance_row_weights`: the balancing term.
- :func:`support_balance_row_weights`: meshrl's support-balancing variant (unconditioned, one-sided).
- :mod:`meshrl.mesh.coach`: offline prefix generation, validation, cache, anti-hacking template.
- :func:`budget_groups`: rollouts per prefix under the ``matched`` / ``per_prefix`` budgets.
"""

from meshrl.mesh.balance import REDUCTIONS, strategy_balance_loss, strategy_balance_row_weights
from meshrl.mesh.budget import BUDGET_MODES, baseline_group_size, budget_groups
from meshrl.mesh.coach import (
    CallableBackend,
    OpenAIChatBackend,
    RuleCoach,
    generate_prefixes,
    load_prefixes,
    prefixes_by_problem,
    query_key,
    wrap_prefix,
)
from meshrl.mesh.support import support_balance_row_weights

__all__ = [
    "BUDGET_MODES",
    "REDUCTIONS",
    "CallableBackend",
    "OpenAIChatBackend",
    "RuleCoach",
    "baseline_group_size",
    "budget_groups",
    "generate_prefixes",
    "load_prefixes",
    "prefixes_by_problem",
    "query_key",
    "strategy_balance_loss",
    "strategy_balance_row_weights",
    "support_balance_row_weights",
    "wrap_prefix",
]
