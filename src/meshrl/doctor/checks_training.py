"""Checks on the per-step training curves: reward collapse, entropy, length, KL and importance-ratio tails,
gradient spikes, non-finite steps, rollout/training mismatch, lagged rollouts the correction does not hold, stalls,
learning-rate mistakes and bf16 that the CPU emulated.

Each check is ``check(records, thresholds) -> list[Finding] | Unchecked``: an empty list means "checked, no
problem", :class:`Unchecked` says which metric was missing. Thresholds: :mod:`meshrl.doctor.thresholds`.
"""

from __future__ import annotations

import math
import statistics

from meshrl.doctor.findings import Finding, Unchecked, confidence, fmt, need, sample_texts, smooth, windows
from meshrl.doctor.records import RunRecords
from meshrl.doctor.thresholds import Thresholds

Result = list[Finding] | Unchecked


def reward_key(rec: RunRecords) -> str | None:
    """What the policy sampled: ``reward/sampled_mean`` (all rollouts, also under dynamic sampling), else
    ``reward/mean``."""
    return rec.first_of("reward/sampled_mean", "reward/mean")


# Held-out bookkeeping, not a score: counts of failed or skipped items (``eval/reward_errors`` would otherwise match
# "reward" below and read as a held-out curve that never falls).
_EVAL_BOOKKEEPING = ("error", "timeout", "skipped")


def eval_accuracy_key(rec: RunRecords) -> str | None:
    keys = sorted({k for r in rec.evals for k, v in r.items() if k.startswith("eval/") and isinstance(v, float)
                   and not any(word in k for word in _EVAL_BOOKKEEPING)})
    for pattern in ("eval/mean@1", "mean@", "acc", "reward", "score"):
        hit = next((k for k in keys if pattern in k), None)
        if hit:
            return hit
    return keys[0] if keys else None


def eval_points(rec: RunRecords, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of the held-out ``key``, in step order; a resumed run's repeated step keeps its later
    record (file order must not decide which evaluation is the latest)."""
    at_step = {int(r["step"]): r[key] for r in rec.evals
               if isinstance(r.get("step"), int | float) and math.isfinite(r.get(key, math.nan))}
    return sorted(at_step.items())


def _eval_fall(rec: RunRecords, th: Thresholds) -> dict[str, float | str] | None:
    """Best held-out value vs the latest one, when two or more evaluations exist."""
    key = eval_accuracy_key(rec)
    if key is None:
        return None
    pts = eval_points(rec, key)
    if len(pts) < 2:
        return None
    best_step, best = max(pts, key=lambda p: p[1])
    last_step, last = pts[-1]
    return {"eval_key": key, "eval_best": fmt(best), "eval_best_step": best_step, "eval_last": fmt(last),
            "eval_last_step": last_step, "eval_fell": "yes" if best - last >= th.eval_drop_min else "no"}


def check_reward_collapse(rec: RunRecords, th: Thresholds) -> Result:
    key = reward_key(rec)
    if key is None:
        return Unchecked("reward_collapse", "no reward/mean (or reward/sampled_mean) in the records")
    missing = need(rec, "reward_collapse", key, min_steps=th.min_steps)
    if missing:
        return missing
    xs, ys = rec.series(key)
    sm = smooth(ys)
    first, last = windows(ys, th)
    peak_i = max(range(len(sm)), key=sm.__getitem__)
    rise, drop = sm[peak_i] - first, sm[peak_i] - last
    if rise < th.collapse_rise_min or drop < th.collapse_drop_frac * rise or peak_i == len(sm) - 1:
        return []
    # The last window's raw mean can sit below every smoothed value after the peak (a final dip the 3-step average
    # flattens): then the fall is dated at the last step.
    fall_i = next((i for i in range(peak_i, len(sm)) if sm[i] <= sm[peak_i] - drop / 2), len(sm) - 1)
    evidence = {"metric": key, "first_window": fmt(first), "peak": fmt(sm[peak_i]), "peak_step": xs[peak_i],
                "last_window": fmt(last), "rise": fmt(rise), "given_back": fmt(drop / rise)}
    held = _eval_fall(rec, th)
    evidence.update(held or {"eval_fell": "unknown (fewer than two held-out evaluations)"})
    fell = held is not None and held["eval_fell"] == "yes"
    # An alarm says the run is broken; a held-out evaluation made at or after the fall that shows no fall says
    # otherwise (a step reward over a few problems is noisy: a 2-step window can give back a third by chance), so
    # the finding is then a warning. An evaluation from before the fall has not seen it, and leaves the alarm.
    seen = held is not None and int(held["eval_last_step"]) >= xs[fall_i]
    severity = "warning" if seen and not fell else "alarm"
    held_out = ("fell too" if fell else "did not fall" if seen else
                f"was last evaluated at step {held['eval_last_step']}, before the fall" if held else
                "was not evaluated twice")
    what = (f"{key} rose by {rise:.3g} to {sm[peak_i]:.3g} at step {xs[peak_i]}, then fell back to {last:.3g} "
            f"(from step {xs[fall_i]}); held-out accuracy {held_out}")
    return [Finding("reward_collapse", "Reward collapse after a rise", severity, [xs[peak_i], xs[fall_i]], what,
                    evidence, "lower optim.lr or raise optim.warmup_steps; regularise (algo.kl_coef, "
                    "algo.clip_high); keep the best checkpoint (summary.json 'best'); check the parser findings "
                    "below before blaming the policy",
                    confidence(drop / max(th.collapse_drop_frac * rise, 1e-12), len(ys), th, persistent=fell or
                               held is None), sample_texts(rec, [xs[peak_i], xs[-1]]))]


def _entropy_jump(rec: RunRecords, th: Thresholds, xs: list[int], ys: list[float]) -> Finding | None:
    """One step that moved the entropy by ``entropy_step_change`` of its previous value, with no reward gain."""
    jumps = [(i, ys[i] - ys[i - 1]) for i in range(1, len(ys))
             if abs(ys[i] - ys[i - 1]) >= max(th.entropy_step_change * ys[i - 1], th.entropy_explosion_min_abs)]
    rkey = reward_key(rec)
    if not jumps or rkey is None:
        return None
    rewards = rec.series(rkey)[1]
    before, after = windows(rewards, th)
    if after >= th.solved_reward or after - before >= th.collapse_rise_min:
        return None  # a sharper policy that solves the task is learning, not a wrecked update
    i, delta = max(jumps, key=lambda j: abs(j[1]) / max(ys[j[0] - 1], 1e-12))
    return Finding(
        "update_blowup", "One update wrecked the policy", "alarm", [xs[i]],
        f"between steps {xs[i - 1]} and {xs[i]} the mean token entropy went from {ys[i - 1]:.3g} to {ys[i]:.3g} "
        f"nats in one update, and the reward did not improve ({before:.3g} -> {after:.3g}): the step size is "
        "far too large", {"entropy_before": fmt(ys[i - 1]), "entropy_after": fmt(ys[i]),
                          "relative_change": fmt(delta / max(ys[i - 1], 1e-12)), "reward_first_window": fmt(before),
                          "reward_last_window": fmt(after), "lr": rec.config.get("lr")},
        "lower optim.lr (by 10-100x), add warm-up (optim.warmup_steps), lower optim.max_grad_norm",
        confidence(abs(delta) / max(th.entropy_step_change * ys[i - 1], 1e-12), len(ys), th),
        sample_texts(rec, [xs[i]]))


def check_entropy(rec: RunRecords, th: Thresholds) -> Result:
    missing = need(rec, "entropy", "entropy/mean", min_steps=th.min_steps)
    if missing:
        return missing
    xs, ys = rec.series("entropy/mean")
    first, last = windows(ys, th)
    peak = max(ys)
    jump = _entropy_jump(rec, th, xs, ys)
    out = [jump] if jump else []
    if first > 0 and last < th.entropy_collapse_frac * first:
        at = next(x for x, y in zip(xs, ys, strict=True) if y < th.entropy_collapse_frac * first)
        rkey = reward_key(rec)
        solved = rkey is not None and windows(rec.series(rkey)[1], th)[1] >= th.solved_reward
        out.append(Finding(
            "entropy_collapse", "Entropy collapse", "info" if solved else "warning", [at],
            f"mean token entropy fell from {first:.3g} to {last:.3g} nats (below {th.entropy_collapse_frac:g}x "
            f"the start from step {at})" + ("; the task is solved, so a sharp policy is expected" if solved else
                                            ": exploration has stopped before the task is solved"),
            {"first_window": fmt(first), "last_window": fmt(last), "ratio": fmt(last / first)},
            "raise rollout.temperature, use clip-higher (algo.clip_high=0.28, DAPO), lower optim.lr, or add an "
            "entropy/KL term (algo.kl_coef)",
            confidence(th.entropy_collapse_frac * first / max(last, 1e-12), len(ys), th),
            sample_texts(rec, [xs[-1]])))
    high = max(last, peak)
    if first > 0 and high > th.entropy_explosion_factor * first and high - first >= th.entropy_explosion_min_abs:
        at = next(x for x, y in zip(xs, ys, strict=True) if y > th.entropy_explosion_factor * first)
        out.append(Finding(
            "entropy_explosion", "Entropy explosion", "alarm", [at],
            f"mean token entropy rose from {first:.3g} to {high:.3g} nats (above {th.entropy_explosion_factor:g}x "
            f"the start from step {at}): the policy is drifting towards uniform noise",
            {"first_window": fmt(first), "last_window": fmt(last), "peak": fmt(peak)},
            "lower optim.lr (by 10x), lower optim.max_grad_norm, add warm-up (optim.warmup_steps)",
            confidence(high / (th.entropy_explosion_factor * first), len(ys), th), sample_texts(rec, [at, xs[-1]])))
    return out


def check_length(rec: RunRecords, th: Thresholds) -> Result:
    missing = need(rec, "length", "len/response_mean", min_steps=th.min_steps)
    if missing:
        return missing
    xs, ys = rec.series("len/response_mean")
    first, last = windows(ys, th)
    if first <= 0 or abs(last - first) < th.length_min_change:
        return []
    ratio = last / first
    if ratio >= th.length_blowup_factor:
        fid, title, knob = ("length_blowup", "Response length blow-up",
                            "use a length-neutral aggregation (algo.loss_agg=seq-mean-token-sum-norm, Dr. GRPO), "
                            "DAPO's overlong shaping, or a lower rollout.max_new_tokens")
        margin = ratio / th.length_blowup_factor
    elif ratio <= th.length_collapse_factor:
        fid, title, knob = ("length_collapse", "Response length collapse",
                            "check for a reward that favours short answers (or an empty-answer exploit); use "
                            "token-level aggregation (algo.loss_agg=token-mean)")
        margin = th.length_collapse_factor / max(ratio, 1e-12)
    else:
        return []
    return [Finding(fid, title, "warning", [xs[-1]],
                    f"mean response length went from {first:.3g} to {last:.3g} tokens ({ratio:.2g}x)",
                    {"first_window": fmt(first), "last_window": fmt(last), "ratio": fmt(ratio)}, knob,
                    confidence(margin, len(ys), th), sample_texts(rec, [xs[-1]]))]


def check_kl(rec: RunRecords, th: Thresholds) -> Result:
    missing = need(rec, "kl_blowup", "kl/mean")
    if missing:
        return Unchecked("kl_blowup", missing.reason + " (the recipe has no KL term)")
    xs, ys = rec.series("kl/mean")
    over = [x for x, y in zip(xs, ys, strict=True) if y > th.kl_max]
    first, last = windows(ys, th)
    grew = len(ys) >= th.min_steps and last > th.kl_max / 10 and last > th.kl_growth_factor * max(first, 1e-12)
    if not over and not grew:
        return []
    return [Finding("kl_blowup", "KL to the reference blew up", "warning", over[:5] or [xs[-1]],
                    f"KL to the reference reached {max(ys):.3g} nats (limit {th.kl_max:g})" if over else
                    f"KL to the reference grew {last / max(first, 1e-12):.3g}x (from {first:.3g} to {last:.3g})",
                    {"max": fmt(max(ys)), "first_window": fmt(first), "last_window": fmt(last),
                     "steps_over_limit": len(over)},
                    "raise algo.kl_coef, lower optim.lr, or clip tighter (algo.clip_low / algo.clip_high)",
                    confidence(max(ys) / th.kl_max, len(ys), th, persistent=len(over) > 1))]


def check_ratio_tail(rec: RunRecords, th: Thresholds) -> Result:
    key = rec.first_of("ratio/max", "clip/frac")
    if key is None:
        return Unchecked("ratio_tail", "neither ratio/max nor a clipped-token share (clip/frac) is in the records")
    evidence, steps, margins = {}, set(), []
    for k, limit, test in (("ratio/max", th.ratio_max, lambda y: y > th.ratio_max),
                           ("ratio/mean", th.ratio_mean_dev, lambda y: abs(y - 1) > th.ratio_mean_dev),
                           ("clip/frac", th.clip_frac_max, lambda y: y > th.clip_frac_max)):
        xs, ys = rec.series(k)
        hit = [(x, y) for x, y in zip(xs, ys, strict=True) if test(y)]
        if hit:
            worst = max(hit, key=lambda p: abs(p[1] - (1 if k == "ratio/mean" else 0)))
            evidence[k] = {"worst": fmt(worst[1]), "at_step": worst[0], "steps_over": len(hit), "limit": limit}
            steps |= {x for x, _ in hit}
            margins.append(abs(worst[1] - (1 if k == "ratio/mean" else 0)) / limit)
    if not steps:
        return []
    return [Finding("ratio_tail", "Importance-ratio tail", "warning", sorted(steps)[:10],
                    "the importance ratio pi_new / pi_old has a heavy tail: " + "; ".join(
                        f"{k} {v['worst']} at step {v['at_step']} ({v['steps_over']} step(s) over {v['limit']:g})"
                        for k, v in evidence.items()),
                    evidence, "fewer PPO epochs / mini-batches (train.ppo_epochs, train.mini_batches), lower "
                    "optim.lr, sequence-level ratios (recipe gspo) or truncated IS",
                    confidence(max(margins), len(rec.steps), th, persistent=len(steps) > 1))]


def check_grad_spikes(rec: RunRecords, th: Thresholds) -> Result:
    missing = need(rec, "grad_spike", "grad/norm", min_steps=th.grad_min_history + 1)
    if missing:
        return missing
    xs, ys = rec.series("grad/norm")
    spikes = []
    for i in range(th.grad_min_history, len(ys)):
        hist = [y for y in ys[max(0, i - th.grad_window):i] if y > 0]
        if len(hist) >= th.grad_min_history and ys[i] > th.grad_spike_factor * statistics.median(hist):
            spikes.append((xs[i], ys[i], statistics.median(hist)))
    if not spikes:
        return []
    worst = max(spikes, key=lambda s: s[1] / s[2])
    return [Finding("grad_spike", "Gradient-norm spikes", "warning", [s[0] for s in spikes][:10],
                    f"{len(spikes)} step(s) with a pre-clip gradient norm over {th.grad_spike_factor:g}x the median "
                    f"of the previous {th.grad_window} steps; worst {worst[1]:.3g} at step {worst[0]} "
                    f"(median {worst[2]:.3g})",
                    {"spikes": [{"step": s, "grad_norm": fmt(g), "median_before": fmt(m)} for s, g, m in spikes[:10]]},
                    "lower optim.lr or optim.max_grad_norm; add warm-up (optim.warmup_steps); look at the samples of "
                    "those steps for a degenerate batch",
                    confidence(worst[1] / (th.grad_spike_factor * worst[2]), len(ys), th,
                               persistent=len(spikes) > 1), sample_texts(rec, [worst[0]]))]


NONFINITE_KEYS = ("loss/total", "loss/policy", "grad/norm", "reward/mean", "entropy/mean", "kl/mean")


def check_nonfinite(rec: RunRecords, th: Thresholds) -> Result:
    skipped = [int(r["step"]) for r in rec.steps if r.get("skipped/nonfinite", 0) > 0]
    skipped += [int(e["step"]) for e in rec.events
                if e.get("event") in ("nonfinite_skip", "nonfinite_abort") and isinstance(e.get("step"), int)]
    bad = {int(r["step"]): [k for k in NONFINITE_KEYS if k in r and not math.isfinite(r[k])] for r in rec.steps}
    bad = {s: ks for s, ks in bad.items() if ks}
    steps = sorted(set(skipped) | set(bad))
    if not steps:
        return []
    aborted = any(e.get("event") == "nonfinite_abort" for e in rec.events)
    return [Finding("nonfinite", "Non-finite steps", "alarm", steps[:20],
                    f"{len(steps)} step(s) had a non-finite loss, gradient or metric"
                    + ("; the run stopped (failure.max_nonfinite)" if aborted else ""),
                    {"steps": steps[:20], "metrics": {str(s): ks for s, ks in list(bad.items())[:10]},
                     "skipped_by_trainer": len(set(skipped)), "aborted": aborted},
                    "lower optim.lr; turn off bf16 autocast (train.autocast_bf16=false) if it is on; check the "
                    "reward for NaN", "high", sample_texts(rec, steps[:1]))]


def check_mismatch(rec: RunRecords, th: Thresholds) -> Result:
    key = rec.first_of("mismatch/logp_diff_max", "mismatch/kl", "mismatch/is_ratio_max", "mismatch/logp_absdiff_mean")
    if key is None:
        why = ("no mismatch/* metrics (a meshrl run before they were logged, or a backend without the sampler's "
               "log-probs)" if rec.engine == "meshrl" else
               "no rollout-vs-training log-prob metric (TRL: sampling/sampling_logp_difference/*, with vLLM; verl: "
               "rollout_corr/* or training/rollout_probs_diff_*, with calculate_log_probs)")
        return Unchecked("rollout_mismatch", why)
    limits = {"mismatch/logp_diff_max": th.mismatch_logp_diff_max, "mismatch/kl": th.mismatch_kl,
              "mismatch/is_ratio_max": th.ratio_max, "mismatch/logp_absdiff_mean": th.mismatch_logp_absdiff_mean,
              "mismatch/logp_absdiff_max": th.mismatch_logp_diff_max}
    evidence, steps, margin = {}, set(), 0.0
    for k, limit in limits.items():
        xs, ys = rec.series(k)
        hit = [(x, y) for x, y in zip(xs, ys, strict=True) if y > limit]
        if hit:
            evidence[k] = {"max": fmt(max(y for _, y in hit)), "steps_over": len(hit), "limit": limit}
            steps |= {x for x, _ in hit}
            margin = max(margin, max(y for _, y in hit) / limit)
    if not steps:
        return []
    return [Finding("rollout_mismatch", "Rollout / training log-prob mismatch", "warning", sorted(steps)[:10],
                    "the sampler's log-probs and the trainer's disagree: " + "; ".join(
                        f"{k} up to {v['max']} ({v['steps_over']} step(s) over {v['limit']:g})"
                        for k, v in evidence.items()),
                    evidence, "run rollout and update in the same precision (e.g. fp32 logits / lm_head; meshrl: "
                    "rollout.autocast_bf16 and train.autocast_bf16 alike), or turn on importance-sampling correction "
                    "(meshrl plugins.rollout_corr.enabled=true; TRL vllm_importance_sampling_correction; verl "
                    "algorithm.rollout_correction.rollout_is=token)",
                    confidence(margin, len(rec.steps), th, persistent=len(steps) > 1))]


#: The stale-step judgements of ``stale_rollouts``: (metric, threshold name, "below" / "above", what it measures).
STALE_TESTS = (("rollout_corr/ess", "stale_ess_min", "below", "effective sample size of the importance weights"),
               ("rollout_corr/frac_truncated", "stale_truncated_max", "above", "share of truncated weights"))
STALE_KNOB = ("lower rollout.max_staleness; lower optim.lr (each step of lag then moves the policy less); use "
              "rollout.staleness_correction=m2po; raise plugins.rollout_corr.threshold only knowingly (fewer "
              "truncated weights, but the variance the truncation held back comes through)")


def _prefixed(rec: RunRecords, prefix: str) -> bool:
    return any(k.startswith(prefix) for r in rec.steps for k in r)


def _persistent(bad: set[int], stale: list[int], th: Thresholds) -> bool:
    """Failing on at least two steps and ``stale_step_share`` of the stale steps, over the whole run or over its
    last window (so that a correction that fails late in a long run is seen): one step is a blip."""
    w = min(len(stale), max(th.min_window, int(round(len(stale) * th.window_frac))))
    for span in (stale, stale[-w:]):
        n = sum(s in bad for s in span)
        if n >= 2 and n >= th.stale_step_share * len(span):
            return True
    return False


def check_stale(rec: RunRecords, th: Thresholds) -> Result:
    """Lagged rollouts (``rollout.max_staleness = k >= 1``, the ``lag/*`` metrics): a lag trained on without a
    correction, or a truncated-IS correction (``rollout_corr/*``) whose weights degenerate on the stale steps. An
    engine whose loss itself corrects the lag says so in ``config["staleness_correction"]`` (TRL's AsyncGRPOTrainer:
    a clipped ratio to the sampler's log-probs); like M2PO's mask, that is only checked for being there."""
    if not _prefixed(rec, "lag/"):
        why = ("no lag/* metrics: rollouts are not lagged (rollout.max_staleness = 0, or a run from before lagged "
               "rollouts)" if rec.engine == "meshrl" else f"no lag/* metrics: {rec.engine} runs do not log "
               "meshrl's lagged rollouts")
        return Unchecked("stale_rollouts", why)
    lag: dict[int, float] = {}  # step -> staleness (the largest of its rows; the mean where only that is logged)
    for r in rec.steps:
        d = next((r[k] for k in ("lag/staleness_max", "lag/staleness_mean") if math.isfinite(r.get(k, math.nan))),
                 None)
        if d is not None:
            lag[int(r["step"])] = d
    if not lag:
        return Unchecked("stale_rollouts", "lag/* metrics without lag/staleness_max or lag/staleness_mean")
    stale = sorted(s for s, d in lag.items() if d > 0)
    if not stale:
        return []  # every batch was sampled from the weights it was trained on (a run shorter than its lag)
    k = max(lag.values())
    corr, m2po = _prefixed(rec, "rollout_corr/"), _prefixed(rec, "m2po/")
    base = {"staleness_max": fmt(k), "staleness_mean": fmt(statistics.fmean(rec.series("lag/staleness_mean")[1]))
            if rec.first_of("lag/staleness_mean") else None, "stale_steps": len(stale)}
    ages = sorted({key.removeprefix("lag/staleness/") for r in rec.steps for key in r
                   if key.startswith("lag/staleness/")}, key=lambda d: (len(d), d))
    if ages:  # the mean share of the rows d trainer steps stale, over the steps that logged the lag
        base["row_share_by_staleness"] = {d: fmt(sum(r.get(f"lag/staleness/{d}", 0.0) for r in rec.steps
                                                     if int(r["step"]) in lag) / len(lag)) for d in ages}
    if not corr and not m2po and rec.config.get("staleness_correction"):
        return []  # corrected by the engine's own loss (a clipped ratio to the sampler: ratio_tail judges its clipping)
    if not corr and not m2po:
        return [Finding("stale_rollouts", "Lagged rollouts trained on uncorrected", "warning", stale[:1],
                        f"rollout.staleness_correction=none: stale batches are trained on uncorrected ({len(stale)} "
                        f"step(s) with batches up to {k:g} optimiser step(s) old, from step {stale[0]}; neither "
                        "rollout_corr/* nor m2po/* is logged)", base,
                        "set rollout.staleness_correction=tis (the default) or m2po, or rollout.max_staleness=0",
                        "high")]
    if not corr:
        return []  # corrected by M2PO's mask (m2po/*), which no threshold judges
    judged = [t for t in STALE_TESTS if rec.first_of(t[0])]
    if not judged:
        return Unchecked("stale_rollouts", "a lagged run with rollout_corr/* but neither rollout_corr/ess nor "
                                           "rollout_corr/frac_truncated in its records")
    on_stale = set(stale)
    bad: set[int] = set()
    evidence, parts, margin = dict(base), [], 1.0
    for key, name, side, measures in judged:
        limit = getattr(th, name)
        pts = [(x, y) for x, y in zip(*rec.series(key), strict=True) if x in on_stale]
        hit = [(x, y) for x, y in pts if (y < limit if side == "below" else y > limit)]
        if not hit:
            continue
        bad |= {x for x, _ in hit}
        worst = sorted(hit, key=lambda p: p[1], reverse=side == "above")[:3]
        evidence[key] = {"limit": limit, f"steps_{side}": len(hit), "of_stale_steps": len(pts),
                         "worst": [{"step": x, "value": fmt(y)} for x, y in worst]}
        parts.append(f"{key} ({measures}) {side} {limit:g} on {len(hit)} of {len(pts)} stale step(s), worst "
                     + ", ".join(f"{y:.3g} at step {x}" for x, y in worst))
        w = worst[0][1]
        margin = max(margin, limit / max(w, 1e-12) if side == "below" else w / max(limit, 1e-12))
    if not _persistent(bad, stale, th):
        return []
    missing = [t[0] for t in STALE_TESTS if t not in judged]
    if missing:
        evidence["not_logged"] = missing
    wmax = [y for x, y in zip(*rec.series("rollout_corr/weight_max"), strict=True) if x in bad]
    if wmax:
        evidence["weight_max_on_those_steps"] = fmt(max(wmax))
    steps = sorted(bad)
    return [Finding("stale_rollouts", "The correction does not hold the rollout lag", "warning", steps[:10],
                    f"on {len(steps)} of {len(stale)} stale step(s) (staleness up to k = {k:g} trainer steps, "
                    "lag/staleness_max) the importance weights pi_update / pi_sampler degenerate: "
                    + "; ".join(parts), evidence, STALE_KNOB,
                    confidence(margin, len(stale), th, persistent=True))]


def check_stall(rec: RunRecords, th: Thresholds) -> Result:
    key = reward_key(rec)
    if key is None:
        return Unchecked("stall", "no reward/mean in the records")
    missing = need(rec, "stall", key, min_steps=th.min_steps) or need(rec, "stall", "adv/abs_mean")
    if missing:
        return missing
    _, ys = rec.series(key)
    sm = smooth(ys)
    spread = max(sm) - min(sm)
    adv = statistics.fmean(rec.series("adv/abs_mean")[1])
    if spread >= th.stall_reward_range or adv >= th.stall_adv_abs:
        return []
    return [Finding("stall", "Training stalled", "warning", [int(rec.steps[0]["step"]), int(rec.steps[-1]["step"])],
                    f"{key} stayed within {spread:.3g} over the run while the mean |advantage| was {adv:.3g}: "
                    "no learning signal reached the update",
                    {"reward_range": fmt(spread), "adv_abs_mean": fmt(adv), "reward_mean": fmt(statistics.fmean(ys))},
                    "make the task's reward vary within a group (problems neither always solved nor never), raise "
                    "rollout.group_size, or use dynamic sampling (recipe dapo)",
                    confidence(th.stall_adv_abs / max(adv, 1e-12), len(ys), th))]


def check_lr(rec: RunRecords, th: Thresholds) -> Result:
    xs, ys = rec.series("lr")
    cfg = rec.config
    if not ys and cfg.get("lr") is None:
        return Unchecked("lr_schedule", "no logged learning rate (lr) and no configured one")
    out = []
    warm, total = cfg.get("warmup_steps"), cfg.get("steps")
    if isinstance(warm, int | float) and isinstance(total, int | float) and warm > total > 0:
        out.append(Finding("lr_schedule", "Warm-up longer than the run", "warning", [int(total)],
                           f"optim.warmup_steps={warm:g} > steps={total:g}: the learning rate never reached "
                           f"its configured value", {"warmup_steps": warm, "steps": total},
                           "shorten optim.warmup_steps (a few % of the steps)", "high"))
    if ys and max(ys) <= 0:
        out.append(Finding("lr_schedule", "Learning rate is zero", "alarm", xs[:1],
                           "the logged learning rate is 0 on every step: nothing was trained",
                           {"lr_max": max(ys)}, "set optim.lr (> 0); check the scheduler's warm-up", "high"))
    return out


def check_bf16_emulated(rec: RunRecords, th: Thresholds) -> Result:
    """Steps that ran bf16 on a CPU without native bf16 (the trainer's ``bf16_emulated`` event, written by every
    process start that asked for it there): slow by an order of magnitude or more, with float32 the cure."""
    if rec.engine != "meshrl":
        return Unchecked("bf16_emulated", f"{rec.engine} runs do not record whether the CPU emulated bf16")
    events = [e for e in rec.events if e.get("event") == "bf16_emulated" and isinstance(e.get("step"), int)]
    if not events:
        return []
    first = min(int(e["step"]) for e in events)
    names = sorted({str(n) for e in events for n in (e.get("settings") or [])})
    machine = events[-1].get("cpu") if isinstance(events[-1].get("cpu"), dict) else {}
    step_s = [r["time/step_s"] for r in rec.steps
              if int(r.get("step", -1)) >= first and isinstance(r.get("time/step_s"), int | float)]
    median = statistics.median(step_s) if step_s else None
    what = (f"bf16 ran emulated from step {first} ({', '.join(names) or 'bf16 settings'} on a CPU without native "
            f"bf16: {machine.get('model', 'unknown CPU')}, PyTorch capability {machine.get('capability', '?')})"
            + (f"; median step {median:.1f} s over {len(step_s)} step(s)" if median is not None else ""))
    fallback = ", ".join(n.replace("=true", "=false").replace("=bfloat16", "=float32") for n in names)
    return [Finding("bf16_emulated", "bf16 emulated by the CPU", "warning", [first], what,
                    {"settings": names, "cpu": machine, "median_step_s": fmt(median) if median is not None else None,
                     "process_starts": len(events)},
                    f"train in float32 on this CPU ({fallback}): faster there; bf16 pays on CPUs with AVX-512 or AMX "
                    "and on GPUs", "high")]
