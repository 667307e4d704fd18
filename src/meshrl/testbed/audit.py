"""``testbed:audit``: the second testbed family, a niche that only the rare, longest procedure solves.

Same problems, procedures, traces and parser as ``testbed:add`` (``a+b``, column ``c``, tens-then-ones
``t``, round-and-adjust ``r``), a different niche structure:

- **The audit rule.** On a problem with any carry, a trace must write every carry where it happens:
  only the column procedure does (``c:3+8=11;7+4+1=12;...``); ``t`` and ``r`` hide their carries in a
  multi-digit step and score 0 there. On a problem without a carry every complete, correct trace scores.
- **No budget niche.** The budget (29 characters) admits the longest reference trace of every procedure,
  so length decides nothing; ``c`` is the longest procedure on carry problems (up to 29 characters
  against ``r``'s 20-23).
- **Types**: ``plain`` (no carry: every procedure works) and ``carry`` (only ``c`` works), default mix
  0.75 / 0.25.
- **The warm start makes ``c`` rare**: ``warm_start(task="testbed:audit")`` draws each example's
  procedure from ``AUDIT_PRIOR`` (c 0.1, t 0.45, r 0.45).

So the specialist of ``testbed:add`` has become the only universal procedure, and a collapse onto the
majority procedures (``t``/``r``, rewarded on the 75% plain problems) loses the ``carry`` niche, while a
collapse onto ``c`` would cost nothing. ``docs/testbed_design.md`` has the design.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

from meshrl.tasks import Problem, register_task
from meshrl.testbed.task import (
    A_RANGE,
    B_RANGE,
    COACHES,
    AddTestbed,
    is_eval_pair,
)
from meshrl.testbed.traces import STRATEGIES, trace_reward

AUDIT_TYPES: tuple[str, ...] = ("plain", "carry")
AUDIT_HOME: dict[str, str] = {"plain": "ctr", "carry": "c"}  # procedures that can score on the type
AUDIT_MIX: dict[str, float] = {"plain": 0.75, "carry": 0.25}
AUDIT_BUDGET = 29  # the longest reference trace of any procedure (c on a two-carry problem)
AUDIT_PRIOR: dict[str, float] = {"c": 0.1, "t": 0.45, "r": 0.45}  # warm-start procedure draws


def audit_type(a: int, b: int) -> str:
    """``carry`` when the ones or the tens column carries, else ``plain``."""
    ones = a % 10 + b % 10 >= 10
    tens = (a // 10) % 10 + (b // 10) % 10 + int(ones) >= 10
    return "carry" if ones or tens else "plain"


def audit_feasible(a: int, b: int) -> set[str]:
    """Procedures that can score on ``a+b`` under the audit rule (every one fits the budget)."""
    return {"c"} if audit_type(a, b) == "carry" else set(STRATEGIES)


@lru_cache(maxsize=4)
def audit_pool(held_out: bool) -> dict[str, tuple[tuple[int, int], ...]]:
    """All pairs of each audit type in the train (``held_out=False``) or eval pool (the hash split of
    ``testbed:add``, so no warm start of either family trains on an eval pair)."""
    pools: dict[str, list[tuple[int, int]]] = {t: [] for t in AUDIT_TYPES}
    for a in A_RANGE:
        for b in B_RANGE:
            if is_eval_pair(a, b) == held_out:
                pools[audit_type(a, b)].append((a, b))
    return {t: tuple(v) for t, v in pools.items()}


def make_audit_problem(a: int, b: int) -> Problem:
    """The problem ``a+b`` of ``testbed:audit`` (its type and the procedures that can score in ``meta``)."""
    kind = audit_type(a, b)
    return Problem(f"audit-{a}-{b}", f"{a}+{b}", str(a + b),
                   {"a": a, "b": b, "type": kind, "home": AUDIT_HOME[kind]})


def parse_audit_mix(mix: Any) -> dict[str, float]:
    """Type weights from a dict, two numbers (plain, carry) or ``"plain:0.75,carry:0.25"``, normalised."""
    if mix is None:
        return dict(AUDIT_MIX)
    if isinstance(mix, str):
        mix = {k.strip(): float(v) for k, v in (p.split(":", 1) for p in mix.split(",") if p.strip())}
    if isinstance(mix, list | tuple):
        if len(mix) != len(AUDIT_TYPES):
            raise ValueError(f"testbed:audit: mix needs {len(AUDIT_TYPES)} weights (plain, carry), got {mix}")
        mix = dict(zip(AUDIT_TYPES, mix, strict=True))
    unknown = sorted(set(mix) - set(AUDIT_TYPES))
    if unknown:
        raise ValueError(f"testbed:audit: unknown problem type(s) {unknown} in mix; known: plain, carry")
    w = {t: float(mix.get(t, 0.0)) for t in AUDIT_TYPES}
    if any(v < 0 for v in w.values()) or sum(w.values()) <= 0:
        raise ValueError(f"testbed:audit: mix weights must be >= 0 with a positive sum, got {w}")
    return {t: v / sum(w.values()) for t, v in w.items()}


def sample_audit_problems(n: int, mix: dict[str, float], rng: random.Random, *, held_out: bool) -> list[Problem]:
    """``n`` distinct problems, types in proportion to ``mix`` (largest remainders), shuffled."""
    raw = {t: n * mix[t] for t in AUDIT_TYPES}
    counts = {t: int(raw[t]) for t in AUDIT_TYPES}
    for t in sorted(AUDIT_TYPES, key=lambda t: raw[t] - counts[t], reverse=True)[: n - sum(counts.values())]:
        counts[t] += 1
    pool = audit_pool(held_out)
    pairs: list[tuple[int, int]] = []
    for kind, count in counts.items():
        if count > len(pool[kind]):
            raise ValueError(f"testbed:audit: asked for {count} {kind!r} problems, only {len(pool[kind])} exist")
        pairs.extend(rng.sample(pool[kind], count))
    rng.shuffle(pairs)
    return [make_audit_problem(a, b) for a, b in pairs]


class AuditTestbed(AddTestbed):
    """``testbed:audit``: carries must be shown, a budget every procedure fits, the niche of the rare ``c``."""

    types = AUDIT_TYPES
    niche_types = ("carry",)
    headline_niche = "carry"

    def __init__(self, *, seed: int = 0, size: int = 2000, eval_size: int = 512, mix: Any = None,
                 budget: int = AUDIT_BUDGET, coach: str = "all", follow: bool = False) -> None:
        if size < 1 or eval_size < 0:
            raise ValueError(f"testbed:audit: need size >= 1 and eval_size >= 0, got {size}, {eval_size}")
        if coach not in COACHES or not isinstance(follow, bool) or budget < AUDIT_BUDGET:
            raise ValueError(f"testbed:audit: need coach in {COACHES}, follow true/false and budget >= "
                             f"{AUDIT_BUDGET}, got coach={coach!r} follow={follow!r} budget={budget!r}")
        self.reward, self.coach, self.follow, self.budget = "trace", coach, follow, int(budget)
        self.mix = parse_audit_mix(mix)
        splits = {
            "train": sample_audit_problems(size, self.mix, random.Random(f"testbed-audit-train-{seed}"),
                                           held_out=False),
            "eval": sample_audit_problems(eval_size, self.mix, random.Random(f"testbed-audit-eval-{seed}"),
                                          held_out=True),
        }
        super(AddTestbed, self).__init__("testbed:audit", splits, instruction=None)

    def score(self, completion: str, problem: Problem) -> float:
        """:func:`trace_reward` within the budget; on a ``carry`` problem only a ``c`` trace counts."""
        if problem.meta["type"] == "carry" and not completion.startswith("c:"):
            return 0.0
        return trace_reward(completion, problem.meta["a"], problem.meta["b"], self.budget)

    def feasible(self, problem: Problem) -> set[str]:
        """Procedures that can score on ``problem`` (:func:`audit_feasible`)."""
        return audit_feasible(problem.meta["a"], problem.meta["b"])


@register_task("testbed:audit")
def _testbed_audit(*, seed: int = 0, **options: Any) -> AuditTestbed:
    from meshrl.tasks.base import take_options

    opts = take_options("testbed:audit", options, {"size": 2000, "eval_size": 512, "mix": None,
                                                    "budget": AUDIT_BUDGET, "coach": "all", "follow": False})
    return AuditTestbed(seed=seed, **opts)
