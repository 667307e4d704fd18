"""Per-batch metrics of tool-using episodes, under the names the trainer's log would carry.

* ``turns/mean``: model turns per episode;
* ``turns/limit_frac``: fraction of episodes a limit ended (``Episode.truncated``);
* ``tools/calls_mean``: executed tool calls per episode;
* ``tools/error_frac``: failed calls (raised, timed out, unprintable result) / executed calls;
* ``tools/parse_fail_frac``: model turns whose tool-call markup was refused / model turns;
* ``tools/share/<name>``: calls of tool ``name`` / executed calls, for every tool called at least once;
* ``env/observation_cut_frac``: fraction of episodes whose ``reset`` observation was cut to fit the model
  (in every step of an environment whose ``reset`` returns text, absent for the others).

A fraction with a zero denominator (no calls in the batch) is 0.0, so that every key is a number in every step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from meshrl.agents.episode import Episode


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """The metrics of the module docstring over ``episodes`` (at least one)."""
    if not episodes:
        raise ValueError("episode_metrics needs at least one episode")
    n = len(episodes)
    turns = sum(e.turns for e in episodes)
    calls = Counter(record.name for e in episodes for record in e.tool_calls)
    total_calls = sum(calls.values())
    metrics = {
        "turns/mean": turns / n,
        "turns/limit_frac": sum(e.truncated for e in episodes) / n,
        "tools/calls_mean": total_calls / n,
        "tools/error_frac": _ratio(sum(e.tool_errors for e in episodes), total_calls),
        "tools/parse_fail_frac": _ratio(sum(len(e.parse_failures) for e in episodes), turns),
    }
    if any(e.observation_cut is not None for e in episodes):
        metrics["env/observation_cut_frac"] = sum(bool(e.observation_cut) for e in episodes) / n
    for name in sorted(calls):
        metrics[f"tools/share/{name}"] = calls[name] / total_calls
    return metrics
