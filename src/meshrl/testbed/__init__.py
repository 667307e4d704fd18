"""The collapse testbed: a task family with known strategies and real niches, and its warm start.

Importing this package registers the tasks ``testbed:add``, ``testbed:audit`` and ``testbed:tools`` with
``meshrl.tasks`` (the engine does not import the testbed; a command that wants the task imports ``meshrl.testbed``
first).

* :class:`AddTestbed` (``load_task("testbed:add")``): ``a+b`` with a three-digit ``a`` and a two-digit
  ``b``, three written procedures (column ``c``, tens-then-ones ``t``, round-and-adjust ``r``) and three
  problem types on which different procedures win (``meta["type"]``). Strict reward with a length budget.
* :class:`AuditTestbed` (``load_task("testbed:audit")``): the second family, same procedures, a niche
  (problems with a carry) that only the rare, longest procedure ``c`` may solve (the audit rule).
* :class:`ToolsTestbed` (``load_task("testbed:tools")``, ``meshrl.testbed.tools_task``): the tool-use family,
  strategies are tool patterns (``direct`` / ``calculator``); only the calculator solves the ``mul`` niche.
* :func:`label_strategy`, :func:`reference_trace`: the parser and the reference traces.
* :func:`warm_start`: a small built-in model taught all three procedures, cached on disk.
* :func:`strategy_shares`, :func:`forced_accuracy`, :func:`coached_shares`: ground-truth shares, per-type
  forced accuracy, and how the model reacts to the rule coach's prefixes.
* ``meshrl.testbed.runconfig``: the training and evaluation keys every testbed run shares; ``meshrl.testbed.demo``:
  ``meshrl demo``.

Use: ``docs/testbed.md``; design: ``docs/testbed_design.md``. The experiments run on it live outside the package,
in ``experiments/collapse_testbed/``.
"""

from meshrl.testbed.audit import AUDIT_PRIOR, AUDIT_TYPES, AuditTestbed, audit_feasible, audit_type
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
    COACH_VARIANTS,
    DEFAULT_BUDGET,
    DEFAULT_MIX,
    HOME,
    TYPES,
    AddTestbed,
    ForcedPrompt,
    applicable_prefixes,
    coach_strategies,
    feasible_strategies,
    forced_prompt,
    make_problem,
    prefix_strategy,
    problem_type,
)
from meshrl.testbed.tools_task import ToolsTestbed
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
    "AUDIT_PRIOR",
    "AUDIT_TYPES",
    "COACH_TEXT",
    "COACH_VARIANTS",
    "DEFAULT_BUDGET",
    "DEFAULT_MIX",
    "HOME",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "TYPES",
    "ToolsTestbed",
    "AddTestbed",
    "AuditTestbed",
    "applicable_prefixes",
    "audit_feasible",
    "audit_type",
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
    "prefix_strategy",
    "problem_type",
    "reference_trace",
    "skeleton",
    "strategy_shares",
    "strict_reward",
    "trace_reward",
    "warm_info",
    "warm_start",
]
