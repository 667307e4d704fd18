"""Checks on what was sampled and how it was grouped: garbled output, truncation, reward-parser failures
vs real degradation, reward errors, broken grouping, missing learning signal, strategy collapse.

Same contract as :mod:`meshrl.doctor.checks_training`: ``check(records, thresholds) -> list[Finding] |
Unchecked``.
"""

from __future__ import annotations

import functools
import math
import statistics
import unicodedata

from meshrl.doctor.checks_training import Result, eval_accuracy_key, eval_points
from meshrl.doctor.findings import Finding, Unchecked, confidence, fmt, need, sample_texts, smooth, windows
from meshrl.doctor.records import RunRecords
from meshrl.doctor.thresholds import Thresholds

GRADED_KINDS = ("math", "number", "choice", "exact")  # reward kinds graded on an extracted final answer


def nontext_share(text: str) -> float:
    """Share of characters that are not text: control characters other than whitespace, the Unicode
    replacement character (undecodable bytes), private-use, surrogate and unassigned code points."""
    if not text:
        return 0.0
    bad = sum(1 for ch in text if ch == "\ufffd" or (unicodedata.category(ch) in ("Cc", "Co", "Cs", "Cn")
                                                     and ch not in "\n\r\t"))
    return bad / len(text)


def repetition(text: str) -> tuple[int, float]:
    """(longest run of one repeated character, distinct 4-grams / 4-grams). A phrase of period p repeated
    over n characters has about p distinct 4-grams of n - 3; prose has nearly all distinct (share near 1)."""
    longest, run = (1, 1) if text else (0, 0)
    for a, b in zip(text, text[1:], strict=False):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    grams = [text[i:i + 4] for i in range(len(text) - 3)]
    return longest, (len(set(grams)) / len(grams) if grams else 1.0)


@functools.lru_cache(maxsize=8192)  # the live checks judge the same logged samples at every check
def is_garbled(text: str, th: Thresholds) -> bool:
    if nontext_share(text) >= th.nontext_share:
        return True
    if len(text) < th.repeat_min_chars:
        return False
    run, distinct = repetition(text)
    return run >= th.repeat_run or distinct <= th.distinct_4gram_share


def _sample_windows(rec: RunRecords, th: Thresholds) -> tuple[list[dict], list[dict]] | None:
    rows = [s for s in rec.samples if isinstance(s.get("completion"), str) and isinstance(s.get("step"), int | float)]
    steps = sorted({int(s["step"]) for s in rows})
    if not steps:
        return None
    w = min(len(steps), max(th.min_window, int(round(len(steps) * th.window_frac))))
    first, last = set(steps[:w]), set(steps[-w:])
    return [s for s in rows if s["step"] in first], [s for s in rows if s["step"] in last]


def _no_samples(check: str, rec: RunRecords) -> Unchecked:
    where = {"meshrl": "samples.jsonl is missing or empty (log.samples_per_step=0?)",
             "trl": "no OUTPUT_DIR/completions/*.parquet (GRPOConfig(log_completions=True) writes them)",
             "verl": "verl's file logger writes no completions (give the generation dumps, "
                     "trainer.rollout_data_dir, with --samples)"}
    return Unchecked(check, "no logged completions: " + where.get(rec.engine, "no samples"))


def check_garbled(rec: RunRecords, th: Thresholds) -> Result:
    win = _sample_windows(rec, th)
    if win is None:
        return _no_samples("garbled_output", rec)
    first, last = win
    share_last = sum(is_garbled(s["completion"], th) for s in last) / len(last)
    share_first = sum(is_garbled(s["completion"], th) for s in first) / len(first)
    if share_last < th.garbled_share:
        return []
    texts = [s["completion"] for s in last]
    runs = [repetition(t) for t in texts]
    steps = sorted({int(s["step"]) for s in last})
    evidence = {"garbled_share_last": fmt(share_last), "garbled_share_first": fmt(share_first),
                "nontext_char_share": fmt(statistics.fmean(nontext_share(t) for t in texts)),
                "longest_char_run": max(r for r, _ in runs), "distinct_4gram_share_min": fmt(min(g for _, g in runs)),
                "samples_judged": len(last)}
    since = "from the start (the model's outputs were garbled before training)" if share_first >= th.garbled_share \
        else f"up from {share_first:.0%} in the first logged steps"
    return [Finding("garbled_output", "Garbled output", "warning", steps,
                    f"{share_last:.0%} of the last logged completions look garbled (repeated characters or "
                    f"n-grams, or non-text characters), {since}", evidence,
                    "lower optim.lr; check the chat template and the tokenizer's special tokens; a reward that "
                    "pays per matching character invites repetition", confidence(share_last / th.garbled_share,
                                                                                 len(rec.steps), th),
                    sample_texts(rec, steps[-1:]))]


def check_truncation(rec: RunRecords, th: Thresholds) -> Result:
    missing = need(rec, "truncation", "len/truncated_frac", min_steps=th.min_window)
    if missing:
        return missing
    xs, ys = rec.series("len/truncated_frac")
    first, last = windows(ys, th)
    if last < th.truncation_share:
        return []
    cap = rec.config.get("max_new_tokens")
    evidence = {"truncated_first_window": fmt(first), "truncated_last_window": fmt(last), "max_new_tokens": cap}
    lens = rec.series("len/response_mean")[1]
    pinned = bool(lens) and isinstance(cap, int | float) and windows(lens, th)[1] >= th.pinned_length_frac * cap
    if lens:
        evidence["len_last_window"] = fmt(windows(lens, th)[1])
    evidence["pinned_at_cap"] = pinned
    rising = last - first >= th.truncation_rise
    what = (f"{last:.0%} of the completions end at the length cap" + (f" (max_new_tokens={cap})" if cap else "")
            + (f", up from {first:.0%}: the lengths grew into it" if rising else
               " from the start: answers that need more tokens are cut (fine if the answer fits)"))
    return [Finding("truncation", "Lengths pinned at the maximum", "warning" if rising else "info",
                    [x for x, y in zip(xs, ys, strict=True) if y >= th.truncation_share][:10], what, evidence,
                    "raise rollout.max_new_tokens, or penalise overlong answers (recipe dapo's overlong shaping)",
                    confidence(last / th.truncation_share, len(ys), th), sample_texts(rec, xs[-1:]))]


def check_parser(rec: RunRecords, th: Thresholds) -> Result:
    kind = rec.config.get("reward_kind")
    if kind is None:
        return Unchecked("parser_failure", "the task's reward kind is unknown (task not loadable or not a meshrl run)")
    if kind not in GRADED_KINDS:
        return Unchecked("parser_failure", f"reward kind {kind!r} uses the task's own scorer: there is no standard "
                                           "final-answer extraction to check")
    if rec.config.get("extracts_answer") is False:
        return Unchecked("parser_failure", f"the task's scorer (reward kind {kind!r}) does not grade a strictly "
                                           "extracted final answer, so there is no parser to fail")
    win = _sample_windows(rec, th)
    if win is None:
        return _no_samples("parser_failure", rec)
    from meshrl.rewards import extract_answer

    rows = win[0] + win[1]
    no_answer = [s for s in rows if extract_answer(s["completion"]) is None]
    answered = [s for s in rows if s not in no_answer]
    wrong = [s for s in answered if isinstance(s.get("score"), int | float) and s["score"] < 1]
    share = len(no_answer) / len(rows)
    wrong_share = len(wrong) / len(answered) if answered else math.nan
    if share < th.no_answer_share:
        return []
    steps = sorted({int(s["step"]) for s in no_answer})
    cut = [s for s in no_answer if s.get("truncated") is True]
    cut_share = len(cut) / len(no_answer)
    evidence = {"no_answer_share": fmt(share), "wrong_answer_share": fmt(wrong_share), "reward_kind": kind,
                "no_answer_truncated_share": fmt(cut_share), "samples_judged": len(rows)}
    why = (f"; {cut_share:.0%} of them were cut at the length cap before any answer" if cut_share >= 0.5 else
           "; most of them ended on their own, without the answer format")
    return [Finding("parser_failure", "Reward-parser failures", "alarm", steps[:10],
                    f"{share:.0%} of the logged completions have no extractable final answer (\\boxed{{}}, "
                    "<answer>...</answer> or 'the answer is ...'): their reward is 0 because nothing was parsed, "
                    "not because an answer was wrong" + why + (f"; of those with an answer {wrong_share:.0%} were "
                                                               "wrong" if answered else ""),
                    evidence,
                    "state the answer format in the prompt (task instruction / system prompt), raise "
                    "rollout.max_new_tokens if answers are cut, or use a task-specific scorer",
                    confidence(share / th.no_answer_share, len(rec.steps), th),
                    sample_texts(rec, steps[-1:]))]


def check_reward_errors(rec: RunRecords, th: Thresholds) -> Result:
    missing = need(rec, "reward_errors", "reward/errors", "rollouts/count")
    if missing:
        return missing
    errors = sum(rec.series("reward/errors")[1]) + sum(rec.series("reward/timeouts")[1])
    total = sum(rec.series("rollouts/count")[1])
    share = errors / total if total else 0.0
    if share < th.reward_error_share:
        return []
    steps = [int(r["step"]) for r in rec.steps if r.get("reward/errors", 0) + r.get("reward/timeouts", 0) > 0]
    return [Finding("reward_errors", "Reward errors and timeouts", "alarm", steps[:10],
                    f"{share:.1%} of the reward calls raised or timed out (scored 0)",
                    {"errors": sum(rec.series("reward/errors")[1]), "timeouts": sum(rec.series("reward/timeouts")[1]),
                     "rollouts": total, "share": fmt(share)},
                    "fix the scorer (run with reward.strict=true to see the first traceback) or raise "
                    "reward.timeout_s", confidence(share / th.reward_error_share, len(rec.steps), th))]


def check_grouping(rec: RunRecords, th: Thresholds) -> Result:
    size = rec.config.get("group_size")
    found = []
    if isinstance(size, int | float) and size < 2:
        found.append(f"the configured group size is {size:g}: a group of one rollout has advantage 0")
    keys = ("group/size1_frac", "group/split_arm_frac", "group/mixed_problem_frac")
    if not found and not any(rec.has(k) for k in keys):
        return Unchecked("broken_grouping", "no group/* figures in the records (logged by meshrl >= this version; "
                                            "TRL and verl do not log group ids)")
    evidence: dict[str, object] = {}
    steps: set[int] = set()
    labels = {"group/size1_frac": "groups of one rollout",
              "group/split_arm_frac": "one prompt's rollouts under several group ids",
              "group/mixed_problem_frac": "several prompts under one group id"}
    for k in keys:
        xs, ys = rec.series(k)
        hit = [(x, y) for x, y in zip(xs, ys, strict=True) if y > 0]
        if hit:
            evidence[k] = {"max": fmt(max(y for _, y in hit)), "steps": len(hit)}
            steps |= {x for x, _ in hit}
            found.append(f"{labels[k]} (up to {max(y for _, y in hit):.0%} of the groups, {len(hit)} step(s))")
    if not found:
        return []
    return [Finding("broken_grouping", "Broken advantage groups", "alarm",
                    sorted(steps)[:10] or [int(rec.steps[0]["step"])],
                    "the advantage groups are wrong: " + "; ".join(found), evidence,
                    "give every rollout of one prompt in one step the same group id (verl: uid per prompt "
                    "before repeat; TRL: num_generations > 1 and a batch that holds whole groups)", "high")]


def check_signal(rec: RunRecords, th: Thresholds) -> Result:
    key = rec.first_of("group/flat_frac", "adv/zero_frac")
    emptied = any(r.get("rollouts/kept") == 0 for r in rec.steps)
    if key is None and not emptied:
        return Unchecked("no_learning_signal", "neither group/flat_frac (TRL frac_reward_zero_std) nor adv/zero_frac "
                                               "is in the records")
    key = key or "rollouts/kept"
    values = dict(zip(*rec.series(key), strict=True)) if key != "rollouts/kept" else {}
    for r in rec.steps:  # dynamic sampling dropped every group of the step: all of them were flat
        if r.get("rollouts/kept") == 0 and r.get("rollouts/count", 0) > 0:
            values[int(r["step"])] = 1.0
    xs, ys = sorted(values), [values[x] for x in sorted(values)]
    if not ys:  # only steps that kept nothing out of nothing sampled
        return Unchecked("no_learning_signal", "rollouts/kept is 0 but no step logged rollouts/count > 0")
    flat = [x for x, y in zip(xs, ys, strict=True) if y >= th.flat_group_share]
    share = len(flat) / len(ys)
    if share < th.flat_step_share:
        return []
    all_flat = all(y >= 1 - 1e-9 for y in ys)
    reward = rec.series("reward/mean")[1]
    return [Finding("no_learning_signal", "No learning signal", "alarm" if all_flat else "warning", flat[:10],
                    f"on {share:.0%} of the steps at least {th.flat_group_share:.0%} of the groups had all-equal "
                    f"rewards ({key}): their advantages are 0, so those rollouts teach nothing",
                    {"metric": key, "mean": fmt(statistics.fmean(ys)), "steps_flat": len(flat), "steps": len(ys),
                     "reward_mean": fmt(statistics.fmean(reward)) if reward else None,
                     "reward_std_mean": fmt(statistics.fmean(rec.series("reward/std")[1]))
                     if rec.first_of("reward/std") else None},
                    "check that the reward varies at all (a constant reward is a bug); pick problems the model "
                    "solves sometimes; raise rollout.group_size; dynamic sampling (recipe dapo)",
                    confidence(share / th.flat_step_share, len(ys), th), sample_texts(rec, flat[-1:]))]


def _accuracy_fall(rec: RunRecords, th: Thresholds, after: int) -> tuple[int | None, str | None]:
    """First step >= ``after`` where accuracy (held-out if evaluated, else acc/mean) is ``eval_drop_min`` below
    its best so far."""
    key = eval_accuracy_key(rec)
    if key:
        pts = eval_points(rec, key)
    else:
        key = "acc/mean"
        xs, ys = rec.series(key)
        pts = list(zip(xs, smooth(ys), strict=True))
    best = -math.inf
    for s, v in pts:
        best = max(best, v)
        if s >= after and best - v >= th.eval_drop_min:
            return s, key
    return None, key


def check_strategy(rec: RunRecords, th: Thresholds) -> Result:
    mass_key = rec.first_of("strategy/problem_max_mass", "strategy/max_mass")
    mei_threshold = next((e.get("threshold") for e in rec.events if e.get("event") == "mei_first_crossing"),
                         rec.config.get("mei_threshold"))
    if mass_key is None and not (rec.has("mei/query") and mei_threshold is not None):
        return Unchecked("strategy_collapse", "no strategy/* masses (the task has no strategy parser) and no "
                                              "mei/query with a threshold (diag.mei.every, diag.mei.threshold)")
    crossings: dict[str, int] = {}
    evidence: dict[str, object] = {}
    if mass_key:
        xs, ys = rec.series(mass_key)
        hit = next((x for x, y in zip(xs, ys, strict=True) if y >= th.strategy_max_mass), None)
        evidence[mass_key] = {"first": fmt(ys[0]), "last": fmt(ys[-1]), "max": fmt(max(ys))}
        if hit is not None:
            crossings[mass_key] = hit
    if mei_threshold is not None and rec.has("mei/query"):
        logged = next((int(e["step"]) for e in rec.events if e.get("event") == "mei_first_crossing"), None)
        xs, ys = rec.series("mei/query")
        hit = logged if logged is not None else next((x for x, y in zip(xs, ys, strict=True) if y > mei_threshold),
                                                     None)
        evidence["mei/query"] = {"threshold": mei_threshold, "max": fmt(max(ys)) if ys else None}
        # effective directions (at most G); runs from before it was logged have only G/MEI's median and of-mean
        for k in ("mei/directions", "mei/directions_median", "mei/effective_dirs_median", "mei/effective_dirs_of_mean"):
            if rec.first_of(k):  # a finite value somewhere (a logged NaN is not one)
                evidence[k] = {"last": fmt(rec.series(k)[1][-1])}
        if hit is not None:
            crossings["mei/query"] = hit
    if not crossings:
        return []
    first = min(crossings.values())
    fall, acc_key = _accuracy_fall(rec, th, first)
    evidence.update({"first_crossing": crossings, "accuracy_metric": acc_key, "accuracy_fall_step": fall,
                     "lag_steps": None if fall is None else fall - first})
    what = ("strategy collapse signals crossed their thresholds: " + ", ".join(
        f"{k} at step {s}" for k, s in sorted(crossings.items(), key=lambda p: p[1]))
        + (f"; accuracy ({acc_key}) fell from step {fall}, {fall - first} step(s) later" if fall is not None
           else "; no accuracy fall followed (yet)"))
    return [Finding("strategy_collapse", "Strategy collapse", "warning" if fall is not None else "info",
                    sorted(set(crossings.values()) | ({fall} if fall is not None else set())), what, evidence,
                    "coach prefixes with strategy balancing (recipe mesh, mesh.mu), a higher rollout.temperature, "
                    "or stop at the first crossing and keep that checkpoint",
                    "medium" if fall is not None else "low", sample_texts(rec, [first]))]
