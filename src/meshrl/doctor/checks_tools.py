"""Checks of tool-using (multi-turn) runs, on the episode metrics the trainer logs (docs/agents.md), and of a
reward that rises while nothing is answered correctly.

- ``tool_use_collapse``: the policy stopped calling tools (``tools/calls_mean``, last window against the first),
  the best-known collapse of tool-using RL ("the agent stops calling tools"); an alarm when held-out accuracy fell.
- ``tool_errors``: tool calls that raise, hang or return nothing printable (``tools/error_frac``).
- ``tool_parse_failures``: model turns whose ``<tool_call>`` blocks do not parse (``tools/parse_fail_frac``).
- ``turn_limit``: episodes ended by a limit (turns, tool calls, tokens) instead of an answer (``turns/limit_frac``).
- ``reward_without_accuracy``: the reward rose while accuracy (``acc/mean``) stayed at zero: the reward pays for
  something other than correct answers (a format term, a loophole in the scorer).
"""

from __future__ import annotations

from meshrl.doctor.checks_training import _eval_fall, reward_key
from meshrl.doctor.findings import Finding, Unchecked, confidence, fmt, need, sample_texts, smooth, windows
from meshrl.doctor.records import RunRecords
from meshrl.doctor.thresholds import Thresholds

Result = list[Finding] | Unchecked
TOOL_IDS = ("tool_use_collapse", "tool_errors", "tool_parse_failures", "turn_limit")


def _tool_shares(rec: RunRecords, th: Thresholds) -> dict[str, str]:
    """Each tool's share of the calls, first and last window (``tools/share/<name>``)."""
    names = sorted({k.removeprefix("tools/share/") for r in rec.steps for k in r if k.startswith("tools/share/")})
    out = {}
    for name in names:
        ys = [r.get(f"tools/share/{name}", 0.0) for r in rec.steps if "tools/calls_mean" in r]
        if ys:
            first, last = windows(ys, th)
            out[f"share_{name}"] = f"{first:.2f} -> {last:.2f}"
    return out


def check_tools(rec: RunRecords, th: Thresholds) -> Result:
    missing = need(rec, "tool_use_collapse", "tools/calls_mean", min_steps=th.min_steps)
    if missing:
        if not rec.series("tools/calls_mean")[1]:
            return Unchecked("tool_use_collapse", "no tools/* metrics: not a tool-using run")
        return missing
    return [f for f in (_collapse(rec, th), _rising(rec, th, "tool_errors"), _rising(rec, th, "tool_parse_failures"),
                        _turn_limit(rec, th)) if f is not None]


def _collapse(rec: RunRecords, th: Thresholds) -> Finding | None:
    xs, ys = rec.series("tools/calls_mean")
    first, last = windows(ys, th)
    if first < th.tool_min_calls or last > th.tool_collapse_frac * first:
        return None
    sm = smooth(ys)
    fall = next(x for x, y in zip(xs, sm, strict=True) if y <= (first + last) / 2)
    held = _eval_fall(rec, th)
    fell = held is not None and held["eval_fell"] == "yes"
    evidence = {"calls_first_window": fmt(first), "calls_last_window": fmt(last), **_tool_shares(rec, th),
                **(held or {"eval_fell": "unknown (fewer than two held-out evaluations)"})}
    what = (f"tool calls per episode fell from {first:.2f} to {last:.2f} (half-way by step {fall}); held-out "
            f"accuracy " + ("fell too" if fell else "did not fall" if held else "was not evaluated twice"))
    return Finding("tool_use_collapse", "The policy stopped calling tools", "alarm" if fell else "warning",
                   [fall, xs[-1]], what, evidence,
                   "keep the tool in play: coach-guided exploration toward it (plugins.coach_guide, shape=log), "
                   "forking tokens (plugins.fork), a KL or entropy term; check that no length penalty or turn "
                   "limit makes calling it cost reward",
                   confidence(first / max(last, 1e-9) * th.tool_collapse_frac, len(ys), th, persistent=True),
                   sample_texts(rec, [xs[0], xs[-1]]))


_RISING = {  # id: (metric, threshold name, title, what it counts, knob)
    "tool_errors": ("tools/error_frac", "tool_error_share", "Tool calls fail",
                    "of the tool calls raised, hung or returned nothing printable",
                    "read the errors in the samples; raise the task's tool_timeout_s; fix the tool or its schema "
                    "(the model sees the schema in the prompt)"),
    "tool_parse_failures": ("tools/parse_fail_frac", "tool_parse_share", "Tool calls that do not parse",
                            "of the model's turns held a <tool_call> block that does not parse",
                            "check the prompt shows the tool-call format the parser expects (docs/agents.md); a "
                            "warm start on well-formed calls; on_parse_failure=respond lets the model see why"),
}


def _rising(rec: RunRecords, th: Thresholds, fid: str) -> Finding | None:
    key, name, title, counts, knob = _RISING[fid]
    xs, ys = rec.series(key)
    if len(ys) < th.min_window:
        return None
    first, last = windows(ys, th)
    limit = getattr(th, name)
    if last < limit:
        return None
    rising = last - first >= limit / 2
    what = (f"{last:.0%} {counts} in the last window" + (f", up from {first:.0%}" if rising else " from the start"))
    return Finding(fid, title, "warning", [x for x, y in zip(xs, ys, strict=True) if y >= limit][:10], what,
                   {f"{key}_first_window": fmt(first), f"{key}_last_window": fmt(last)}, knob,
                   confidence(last / limit, len(ys), th), sample_texts(rec, xs[-1:]))


def _turn_limit(rec: RunRecords, th: Thresholds) -> Finding | None:
    xs, ys = rec.series("turns/limit_frac")
    if len(ys) < th.min_window:
        return None
    first, last = windows(ys, th)
    if last < th.turn_limit_share:
        return None
    turns = rec.series("turns/mean")[1]
    evidence = {"limit_first_window": fmt(first), "limit_last_window": fmt(last)}
    if turns:
        evidence["turns_last_window"] = fmt(windows(turns, th)[1])
    return Finding("turn_limit", "Episodes end at a limit, not an answer", "warning",
                   [x for x, y in zip(xs, ys, strict=True) if y >= th.turn_limit_share][:10],
                   f"{last:.0%} of the episodes ended at a limit (turns, tool calls or tokens) in the last window",
                   evidence, "raise the task's max_turns / max_tool_calls / max_total_tokens, or reward answering "
                   "sooner; a loop of the same call is a policy problem, not a limit problem",
                   confidence(last / th.turn_limit_share, len(ys), th), sample_texts(rec, xs[-1:]))


def check_reward_without_accuracy(rec: RunRecords, th: Thresholds) -> Result:
    key = reward_key(rec)
    if key is None:
        return Unchecked("reward_without_accuracy", "no reward/mean (or reward/sampled_mean) in the records")
    missing = need(rec, "reward_without_accuracy", key, "acc/mean", min_steps=th.min_steps)
    if missing:
        return missing
    xs, ys = rec.series(key)
    acc = rec.series("acc/mean")[1]
    first, last = windows(ys, th)
    acc_last = windows(acc, th)[1]
    if last - first < th.collapse_rise_min or max(acc) > th.format_only_acc:
        return []
    what = (f"{key} rose from {first:.3g} to {last:.3g} while accuracy (acc/mean) never passed {max(acc):.2g}: "
            "the reward pays for something other than correct answers")
    return [Finding("reward_without_accuracy", "Reward without correct answers", "warning", [xs[0], xs[-1]], what,
                    {"reward_first_window": fmt(first), "reward_last_window": fmt(last),
                     "acc_max": fmt(max(acc)), "acc_last_window": fmt(acc_last)},
                    "check what the reward pays for: a format or length term, partial credit, a scorer that "
                    "accepts a pattern that is not the answer (reward hacking); read the samples",
                    confidence((last - first) / th.collapse_rise_min, len(ys), th), sample_texts(rec, xs[-1:]))]
