"""The collapse testbed: a task family with known strategies and real niches, and its warm start.

Importing this package registers the task ``testbed:add`` with ``meshrl.tasks`` (the engine does not
import the testbed; a command that wants the task imports ``meshrl.testbed`` first).

* :class:`AddTestbed` (``load_task("testbed:add")``): ``a+b`` with a three-digit ``a`` and a two-digit
  ``b``, three written procedures (column ``c``, tens-then-ones ``t``, round-and-adjust ``r``) and three
  problem types on which different procedures win (``meta["type"]``). Strict reward with a length budget.
* :func:`label_strategy`, :func:`reference_trace`: the parser and the reference traces.
* :func:`warm_start`: a small built-in model taught all three procedures, cached on disk.
* :func:`strategy_shares`, :func:`forced_accuracy`, :func:`coached_shares`: ground-truth shares, per-type
  forced accuracy, and how the model reacts to the rule coach's prefixes.

See ``docs/testbed_design.md``.
"""

from meshrl.testbed.measure import (
    CoachReport,
    ForcedReport,
    ShareReport,
    coached_shares,
    forced_accuracy,
    strategy_shares,
)
from meshrl.testbed.task import (
    COACH_TEXT,
    DEFAULT_BUDGET,
    DEFAULT_MIX,
    HOME,
    TYPES,
    AddTestbed,
    ForcedPrompt,
    coach_strategies,
    feasible_strategies,
    forced_prompt,
    make_problem,
    problem_type,
)
from meshrl.testbed.traces import (
    STRATEGIES,
    STRATEGY_NAMES,
    label_strategy,
    reference_trace,
    skeleton,
    strict_reward,
    trace_reward,
)
from meshrl.testbed.warm import cache_root, warm_info, warm_start

__all__ = [
    "COACH_TEXT",
    "DEFAULT_BUDGET",
    "DEFAULT_MIX",
    "HOME",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "TYPES",
    "AddTestbed",
    "CoachReport",
    "ForcedPrompt",
    "ForcedReport",
    "ShareReport",
    "cache_root",
    "coached_shares",
    "coach_strategies",
    "feasible_strategies",
    "forced_accuracy",
    "forced_prompt",
    "label_strategy",
    "make_problem",
    "problem_type",
    "reference_trace",
    "skeleton",
    "strategy_shares",
    "strict_reward",
    "trace_reward",
    "warm_info",
    "warm_start",
]
