"""Diagnostics against ground truth on the testbed: one probe of a policy, and warning-signal timing.

:func:`probe_signals` samples ``G`` unconditioned rollouts for each of a fixed set of held-out problems
and measures, on the same rollouts, everything a collapse monitor could watch next to what actually
happens (parser labels):

- truth: per-problem max strategy mass (mean over problems), overall masses, strategies in use, accuracy
  overall / per type / on the niches (``carry`` + ``decade``);
- MEI and effective directions ``G / MEI`` per feature map (``bias``, ``head``, ``full`` = the exact
  Fisher score over every parameter), mean over problems; and MEI over the *distinct* rollouts only
  (``mei_distinct/*``: exact copies of one response add identical rows to the Gram matrix and raise MEI with no new
  direction, and on this testbed most of a query's rollouts are copies);
- the coupling-kernel epsilon-partition per feature map and epsilon: its max mass and its adjusted Rand
  index against the parser labels;
- mean token entropy, and the log-probability of each procedure's reference trace (its drift from the
  start is the "per-strategy log-probability drift" signal).

:func:`first_crossing` and :func:`lead_table` turn per-checkpoint probes into the warning table.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import torch

FEATURES = ("bias", "head", "full")
EPSILONS = (0.05, 0.1, 0.2, 0.3, 0.5)
NICHES = ("carry", "decade")


def adjusted_rand_index(a: Sequence[Any], b: Sequence[Any]) -> float:
    """Adjusted Rand index of two labellings of the same items (Hubert & Arabie 1985)::

        ARI = (sum_ij C(n_ij, 2) - E) / (0.5 (sum_i C(a_i, 2) + sum_j C(b_j, 2)) - E),
        E   = sum_i C(a_i, 2) sum_j C(b_j, 2) / C(n, 2)

    with ``n_ij`` the contingency table and ``a_i``, ``b_j`` its margins. 1 = identical partitions, about 0
    for independent ones. When the denominator is 0 (both labellings put everything in one cluster, or
    both make every item a singleton) the partitions are identical and the index is 1.
    """
    if len(a) != len(b):
        raise ValueError(f"labellings differ in length: {len(a)} vs {len(b)}")
    n = len(a)
    if n < 2:
        return 1.0

    def c2(x: int) -> float:
        return x * (x - 1) / 2

    sum_ij = sum(c2(v) for v in Counter(zip(a, b, strict=True)).values())
    sum_a = sum(c2(v) for v in Counter(a).values())
    sum_b = sum(c2(v) for v in Counter(b).values())
    expected = sum_a * sum_b / c2(n)
    denom = 0.5 * (sum_a + sum_b) - expected
    return 1.0 if denom == 0 else (sum_ij - expected) / denom


def distinct_rows(responses: Sequence[Sequence[int]]) -> list[int]:
    """Index of the first occurrence of each distinct response, in order (duplicates dropped)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for i, r in enumerate(responses):
        key = tuple(r)
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


def _grams(model, tok, prompts: list[list[int]], responses: list[list[int]], temperature: float,
           features: Sequence[str]) -> tuple[dict[str, torch.Tensor], float]:
    """Gram matrix per feature map of the rollouts, and their mean token entropy (same forward pass)."""
    from meshrl.analysis import forward_response, pad_id_of
    from meshrl.analysis.census import full_sequences
    from meshrl.diagnostics import bias_features, fisher_scores, head_gram
    from meshrl.trainer import collate, token_entropy

    pad = pad_id_of(tok, [tok.eos_token_id])
    mb = collate(prompts, responses, pad)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        logits, h = forward_response(model, mb, hidden="head" in features)
        mask = mb.response_mask
        entropy = float((token_entropy(logits, temperature) * mask).sum() / mask.sum().clamp(min=1))
        if "bias" in features:
            phi = bias_features(logits, mb.response_ids, mask, temperature).double()
            out["bias"] = phi @ phi.T
        if "head" in features:
            out["head"] = head_gram(logits, mb.response_ids, h, mask, temperature).double()
    if "full" in features:
        ids, am, rm = full_sequences(prompts, responses, pad)
        u = fisher_scores(model, ids, am, rm, temperature=temperature).double()
        out["full"] = u @ u.T
    return out, entropy


def probe_signals(model, tok, task, problems: Sequence, *, group_size: int = 12, seed: int = 0,
                  temperature: float = 1.0, features: Sequence[str] = FEATURES,
                  epsilons: Sequence[float] = EPSILONS) -> dict[str, Any]:
    """Measure one policy on ``problems`` (see the module docstring). Returns ``{"scalars": {...},
    "per_problem": [...]}``; every scalar is a mean over problems unless its name says otherwise."""
    from meshrl.analysis import pad_id_of, sequence_logprobs
    from meshrl.diagnostics import epsilon_partition, mei_from_gram, normalise_kernel, strategy_masses
    from meshrl.models import encode_prompt
    from meshrl.rollout import SamplingParams, make_backend

    was_training = model.training
    model.eval()
    prompts = [encode_prompt(tok, task.format_prompt(p)) for p in problems]
    params = SamplingParams(max_new_tokens=task.max_new_tokens, temperature=temperature, n=group_size)
    roll = make_backend("hf", model, tok).generate(prompts, params, seed=seed)
    names = tuple(task.strategies)
    per_problem, agg = [], defaultdict(list)
    pool: dict[tuple[int, str], tuple[list[int], list[int], str]] = {}
    pad = pad_id_of(tok, [tok.eos_token_id])
    rows_of: dict[int, list[int]] = defaultdict(list)
    for k, pi in enumerate(roll.prompt_index):
        rows_of[pi].append(k)
    for i, problem in enumerate(problems):
        rows = rows_of[i]
        texts = [roll.texts[k] for k in rows]
        responses = [roll.response_ids[k] for k in rows]
        labels = [task.label_strategy(t) or "other" for t in texts]
        correct = [task.score(t, problem) >= 1.0 for t in texts]
        counts = Counter(labels)
        rec: dict[str, Any] = {"id": problem.id, "type": problem.meta.get("type"),
                               "true_strategies": sum(1 for s in names if counts[s]),
                               "true_max_mass": max(counts.values()) / len(labels),
                               "acc": sum(correct) / len(correct)}
        for s in names:
            agg[f"true/mass/{s}"].append(counts[s] / len(labels))
        rec["distinct_frac"] = len(set(texts)) / len(texts)
        for k, lab in zip(rows, labels, strict=True):
            pool.setdefault((i, lab), (prompts[i], roll.response_ids[k], lab))
        grams, rec["entropy"] = _grams(model, tok, [prompts[i]] * len(rows), responses, temperature, features)
        first = distinct_rows(responses)
        for feat, gram in grams.items():
            mei = mei_from_gram(gram)
            rec[f"mei/{feat}"] = mei
            rec[f"mei_distinct/{feat}"] = mei_from_gram(gram[first][:, first])
            rec[f"eff_dirs/{feat}"] = len(rows) / mei if mei and mei == mei else math.nan
            kt = normalise_kernel(gram)
            for eps in epsilons:
                part = epsilon_partition(kt, eps)
                rec[f"kernel_max_mass/{feat}@{eps:g}"] = float(strategy_masses(part)["max_count_mass"])
                rec[f"ari/{feat}@{eps:g}"] = adjusted_rand_index(part.tolist(), labels)
        per_problem.append(rec)
    # Log-probability of each procedure's reference trace (teacher-forced), per problem.
    for s in names:
        refs = [tok.encode(task.reference_trace(p, s), add_special_tokens=False) + [tok.eos_token_id]
                for p in problems]
        lp, _ = sequence_logprobs(model, prompts, refs, pad, temperature)
        agg[f"ref_logp/{s}"].append(float(lp.mean()))
    scalars_pooled = _pooled_agreement(model, tok, [v for v in pool.values() if v[2] != "other"],
                                       temperature, features, epsilons)
    if was_training:
        model.train()
    scalars = {k: sum(v) / len(v) for k, v in agg.items()}
    keys = [k for k in per_problem[0] if k not in ("id", "type")]
    for k in keys:
        vals = [r[k] for r in per_problem if r[k] == r[k]]
        scalars[k] = sum(vals) / len(vals) if vals else math.nan
    by_type = defaultdict(list)
    for r in per_problem:
        by_type[r["type"]].append(r["acc"])
    for t, v in by_type.items():
        scalars[f"acc/type/{t}"] = sum(v) / len(v)
    niches = getattr(task, "niche_types", NICHES)
    niche = [r["acc"] for r in per_problem if r["type"] in niches]
    scalars["acc/niche"] = sum(niche) / len(niche) if niche else math.nan
    scalars["ref_logp/min"] = min(scalars[f"ref_logp/{s}"] for s in names)
    scalars.update(scalars_pooled)
    return {"scalars": scalars, "per_problem": per_problem}


def _pooled_agreement(model, tok, items: list[tuple[list[int], list[int], str]], temperature: float,
                      features: Sequence[str], epsilons: Sequence[float]) -> dict[str, float]:
    """ARI of the epsilon-partition of one rollout per (problem, procedure), pooled across problems.

    Within one query the testbed's procedures are nearly deterministic given the tag, so a query's
    rollouts of one procedure are mostly the *same* text and any partition that merges duplicates
    scores well. Pooling distinct rollouts of different problems asks the real question: do gradients
    group traces by procedure when the texts differ?
    """
    from meshrl.diagnostics import epsilon_partition, normalise_kernel

    if len(items) < 3:
        return {}
    grams, _ = _grams(model, tok, [it[0] for it in items], [it[1] for it in items], temperature, features)
    labels = [it[2] for it in items]
    out = {"pooled/n": float(len(items))}
    for feat, gram in grams.items():
        kt = normalise_kernel(gram)
        for eps in epsilons:
            out[f"pooled_ari/{feat}@{eps:g}"] = adjusted_rand_index(epsilon_partition(kt, eps).tolist(), labels)
        out[f"pooled_ari/{feat}@best"] = max(out[f"pooled_ari/{feat}@{eps:g}"] for eps in epsilons)
    return out


def first_crossing(steps: Sequence[int], values: Sequence[float], threshold: float, direction: str,
                   patience: int = 1) -> int | None:
    """First step from which ``values`` stay beyond ``threshold`` for ``patience`` consecutive points
    (``direction`` ``"up"``: value > threshold; ``"down"``: value < threshold). None if never."""
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
    run = 0
    for k, v in enumerate(values):
        beyond = v == v and (v > threshold if direction == "up" else v < threshold)
        run = run + 1 if beyond else 0
        if run >= patience:
            return steps[k - patience + 1]
    return None


def calibrated_threshold(baseline: Sequence[float], direction: str, k_sd: float = 3.0,
                         min_sd: float = 0.0) -> float:
    """``mean + k sd`` (``"up"``) or ``mean - k sd`` (``"down"``) of the signal over baseline probes
    (the start policy probed with different sampling seeds); ``min_sd`` floors the spread."""
    vals = [v for v in baseline if v == v]
    if len(vals) < 2:
        raise ValueError(f"need at least 2 finite baseline values, got {len(vals)}")
    mean = sum(vals) / len(vals)
    sd = max(math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)), min_sd)
    return mean + k_sd * sd if direction == "up" else mean - k_sd * sd
