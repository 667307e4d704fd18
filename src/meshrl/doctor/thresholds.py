"""Every number ``meshrl doctor`` compares against, in one place (documented in docs/doctor.md).

The defaults were set so that the README quick-start GRPO job (``tiny:repeat``, 20 steps) raises nothing
above ``info`` while each failure built deliberately in ``tests/integration/test_doctor_runs.py`` is named. "Window"
figures are means over the first / last ``window_frac`` of the logged steps (at least ``min_window`` steps),
which keeps single noisy steps from deciding a trend.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Thresholds:
    # ---- shared
    min_steps: int = 5  # fewer logged steps: trend checks are reported as not checkable
    window_frac: float = 0.2  # first / last window as a share of the logged steps
    min_window: int = 2
    solved_reward: float = 0.95  # last-window reward at or above this: the task is solved (low entropy is fine)
    # ---- reward collapse after a rise
    collapse_rise_min: float = 0.1  # peak (smoothed) minus first-window reward must reach this
    collapse_drop_frac: float = 0.5  # and the last window must give back this share of the rise
    eval_drop_min: float = 0.05  # held-out accuracy drop (best - last) that counts as "fell too"
    # ---- entropy
    entropy_collapse_frac: float = 0.1  # last-window entropy below this share of the first window
    entropy_explosion_factor: float = 2.0  # last-window (or peak) entropy above this multiple of the first
    entropy_explosion_min_abs: float = 0.5  # ... and at least this many nats above it
    entropy_step_change: float = 0.5  # one step moving entropy by this share of the previous step's (and by at
    # least entropy_explosion_min_abs nats) without a reward gain: one update wrecked the policy (lr far too high)
    # ---- garbled output (from samples.jsonl)
    repeat_min_chars: int = 24  # completions shorter than this are not judged for repetition
    repeat_run: int = 8  # one character repeated this many times in a row
    distinct_4gram_share: float = 0.3  # or at most this share of its 4-grams are distinct (a phrase on a loop)
    garbled_share: float = 0.3  # share of last-window samples that must look garbled
    nontext_share: float = 0.05  # share of characters that are control / replacement / private-use
    pinned_length_frac: float = 0.95  # mean length at or above this share of max_new_tokens: pinned at the cap
    truncation_share: float = 0.5  # share of completions cut at max_new_tokens
    truncation_rise: float = 0.3  # rise of the truncated share from the first window that makes it a warning
    # ---- reward parser vs real degradation
    no_answer_share: float = 0.5  # share of sampled completions without an extractable final answer
    reward_error_share: float = 0.05  # (reward errors + timeouts) / rollouts
    # ---- length
    length_blowup_factor: float = 3.0  # last-window / first-window mean length
    length_collapse_factor: float = 1 / 3
    length_min_change: float = 2.0  # tokens: smaller absolute changes are never flagged
    # ---- KL, importance ratio, gradients, non-finite values
    kl_max: float = 1.0  # nats per token: KL to the reference above this on any step
    kl_growth_factor: float = 10.0  # last-window KL over first-window KL (with kl_max / 10 as the floor)
    ratio_max: float = 10.0  # largest importance ratio pi_new / pi_old on any step (the tail, not the mean)
    ratio_mean_dev: float = 0.5  # |mean ratio - 1| on any step
    clip_frac_max: float = 0.3  # share of clipped tokens on any step
    grad_spike_factor: float = 10.0  # pre-clip gradient norm over the median of the previous grad_window steps
    grad_window: int = 10
    grad_min_history: int = 3
    # ---- grouping and learning signal
    flat_group_share: float = 0.8  # share of groups with all-equal rewards that means "no signal" on a step
    flat_step_share: float = 0.5  # ... on at least this share of the steps
    # ---- strategy collapse
    strategy_max_mass: float = 0.9  # the largest strategy's share (per query) that counts as collapse
    # ---- rollout / training mismatch
    mismatch_logp_diff_max: float = 1.0  # max |log p_train - log p_rollout| per token on any step
    mismatch_kl: float = 0.01  # rollout-to-training KL (verl rollout_corr/kl) on any step
    # meshrl: mean |log p_update - log p_sampler| on any step. fp32 sampler vs fp32 update agree to ~1e-7 on
    # tiny; a bf16-autocast sampler (or update) against fp32 gives ~5e-4 there (docs/doctor.md).
    mismatch_logp_absdiff_mean: float = 1e-4
    # ---- lagged rollouts (rollout.max_staleness >= 1), judged on the stale steps only (lag/staleness_max > 0)
    stale_ess_min: float = 0.5  # normalised ESS of the untruncated weights (rollout_corr/ess) below this on a step
    stale_truncated_max: float = 0.2  # share of truncated / zeroed weights (rollout_corr/frac_truncated) above this
    stale_step_share: float = 0.2  # ... on at least this share (and two) of the stale steps, whole run or last window
    # ---- tool-using runs (tools/* and turns/* metrics) and a reward without correct answers
    tool_min_calls: float = 0.2  # tool calls per episode in the first window below this: too few to collapse
    tool_collapse_frac: float = 0.5  # last-window calls per episode at or below this share of the first window
    tool_error_share: float = 0.2  # share of tool calls that fail (raise, hang, unprintable), last window
    tool_parse_share: float = 0.2  # share of model turns whose <tool_call> blocks do not parse, last window
    turn_limit_share: float = 0.5  # share of episodes ended by a limit instead of an answer, last window
    format_only_acc: float = 0.02  # accuracy never above this while the reward rose by collapse_rise_min
    # ---- stalls, learning rate
    stall_reward_range: float = 0.02  # smoothed reward range over the run below this: flat
    stall_adv_abs: float = 0.05  # mean |advantage| below this: near-zero signal

    def with_overrides(self, overrides: dict[str, Any]) -> Thresholds:
        """A copy with some fields replaced (``--set`` on the CLI, ``health.thresholds``); unknown names are a
        ``ValueError``, and so is a value that is not a finite number >= 0 (an integer for an integer field),
        each naming the threshold: a NaN would make every comparison false and silently turn its check off."""
        known = {f.name: f.type for f in fields(self)}
        bad = sorted(set(overrides) - set(known))
        if bad:
            raise ValueError(f"unknown doctor threshold(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
        values = asdict(self)
        for k, v in overrides.items():
            values[k] = threshold_value(k, v, type(values[k]))
        return Thresholds(**values)


def threshold_value(name: str, value: Any, kind: type) -> int | float:
    """``value`` of threshold ``name`` as ``kind`` (int or float): a number, or its text (``--set``)."""
    number: Any = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    ok = (not isinstance(number, bool) and isinstance(number, int | float) and math.isfinite(number)
          and number >= 0 and (kind is float or float(number).is_integer()))
    if not ok:
        what = "an integer >= 0" if kind is int else "a finite number >= 0"
        raise ValueError(f"threshold {name} must be {what}, got {value!r}")
    return kind(number)


DEFAULT = Thresholds()
