"""Per-step grouping figures the trainer logs so that ``meshrl doctor`` can see broken advantage groups.

GRPO-family advantages compare each rollout with the other rollouts of its *group* (one query's G samples).
The classic silent failures are bookkeeping ones: the same prompt's samples under several group ids (each
group then has size 1 and a zero advantage), several different prompts under one id (advantages compare
unrelated questions), or groups whose rewards are all equal (no learning signal). This module measures
each from the step's own rows; :mod:`meshrl.doctor.checks` turns them into findings.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

ZERO_ADVANTAGE = 1e-8  # |A| below this counts as "no signal" (group-normalised advantages are O(1))


def _key(x: object) -> Hashable:
    return tuple(x) if isinstance(x, list) else x  # type: ignore[return-value]


def grouping_metrics(group_ids: Sequence[object], query_ids: Sequence[int], strategy_ids: Sequence[int],
                     problem_ids: Sequence[str], rewards: Sequence[float],
                     advantages: Sequence[float]) -> dict[str, float]:
    """Grouping figures of one step's rows (all sequences of the same length ``N``).

    A *draw arm* is one ``(query id, strategy id)``: the rollouts sampled from one prompt text in one step,
    which must all carry one group id. Returns:

    - ``group/count``, ``group/size_min``, ``group/size_mean``, ``group/size1_frac`` (share of groups with
      one rollout: their advantage is 0 by construction);
    - ``group/split_arm_frac``: share of draw arms whose rollouts carry more than one group id;
    - ``group/mixed_problem_frac``: share of groups that contain more than one problem id;
    - ``group/flat_frac``: share of groups whose rewards are all equal (zero std: no learning signal);
    - ``adv/zero_frac``: share of rows with ``|advantage| < 1e-8``.
    """
    n = len(group_ids)
    if not all(len(x) == n for x in (query_ids, strategy_ids, problem_ids, rewards, advantages)):
        raise ValueError("grouping_metrics: every argument needs one entry per rollout")
    if n == 0:
        return {}
    groups: dict[Hashable, list[int]] = defaultdict(list)
    arms: dict[tuple[int, int], set[Hashable]] = defaultdict(set)
    for i, g in enumerate(group_ids):
        groups[_key(g)].append(i)
        arms[(int(query_ids[i]), int(strategy_ids[i]))].add(_key(g))
    sizes = [len(rows) for rows in groups.values()]
    mixed = sum(len({problem_ids[i] for i in rows}) > 1 for rows in groups.values())
    flat = sum(max(rewards[i] for i in rows) - min(rewards[i] for i in rows) <= 1e-12 for rows in groups.values())
    return {
        "group/count": float(len(groups)),
        "group/size_min": float(min(sizes)),
        "group/size_mean": n / len(groups),
        "group/size1_frac": sum(s == 1 for s in sizes) / len(groups),
        "group/split_arm_frac": sum(len(ids) > 1 for ids in arms.values()) / len(arms),
        "group/mixed_problem_frac": mixed / len(groups),
        "group/flat_frac": flat / len(groups),
        "adv/zero_frac": sum(abs(a) < ZERO_ADVANTAGE for a in advantages) / n,
    }
