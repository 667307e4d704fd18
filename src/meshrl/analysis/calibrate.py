"""MEI threshold calibration on the model before RL (docs/method.md §1.2): ``threshold = mean + 3 std``.

For each of ``n_queries`` calibration queries the untrained policy samples ``group_size`` rollouts (hf
backend, the run's sampling temperature); one forward pass over (prompt, rollout) gives the aligned
logits (and, for ``head``, the final hidden states); the per-query MEI of the chosen feature map is
``1^T Phi 1 / tr Phi`` over the query's ``G`` rollouts, with ``p_t = softmax(logits_t / T)`` at the
sampling temperature, as the trainer computes it online. The threshold is ``mean + 3 std`` of the
per-query MEI (sample std, ``ddof = 1``). The paper's 1.013 holds for its models with ``G = 16`` only:
MEI depends on the model, ``G``, the feature map, the temperature and the response length, so every
one of them is written into the result (the trainer rejects another feature map and warns on another ``G``).
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from meshrl.analysis._common import finite_stats, forward_response, load_for_analysis, pad_id_of, progress_bar

CALIBRATION_FEATURES = ("bias", "head")
SIGMAS = 3.0
STD_DDOF = 1


def _check(n_queries: int, group_size: int, feature: str, max_new_tokens: int, temperature: float,
           chunk: int, proj_dim: int | None) -> None:
    if not (isinstance(n_queries, int) and n_queries >= 2):
        raise ValueError(f"n_queries must be an integer >= 2 (a std needs two queries), got {n_queries!r}")
    if not (isinstance(group_size, int) and group_size >= 2):
        raise ValueError(f"group_size must be an integer >= 2, got {group_size!r}")
    if feature not in CALIBRATION_FEATURES:
        raise ValueError(f"feature must be one of {', '.join(CALIBRATION_FEATURES)}, got {feature!r}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (MEI of greedy rollouts is meaningless), "
                         f"got {temperature!r}")
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    if proj_dim is not None and (feature != "head" or not (isinstance(proj_dim, int) and proj_dim >= 1)):
        raise ValueError(f"proj_dim applies to feature 'head' only and must be an integer >= 1, got {proj_dim!r}")


def query_gram(model: torch.nn.Module, prompt: list[int], responses: list[list[int]], pad_id: int, *,
               feature: str, temperature: float, proj_dim: int | None = None, seed: int = 0) -> torch.Tensor:
    """``[G, G]`` float64 Gram matrix of one query's rollouts under the ``bias`` or ``head`` feature map."""
    from meshrl.diagnostics import bias_features, gram_matrix, head_gram
    from meshrl.trainer import collate

    mb = collate([prompt] * len(responses), responses, pad_id)
    with torch.no_grad():
        logits, hidden = forward_response(model, mb, hidden=feature == "head")
        tokens, mask = mb.response_ids.to(logits.device), mb.response_mask.to(logits.device)
        if feature == "bias":
            return gram_matrix(bias_features(logits, tokens, mask, temperature))
        assert hidden is not None
        return head_gram(logits, tokens, hidden, mask, temperature, proj_dim=proj_dim, seed=seed)


def calibrate_mei(
    model_spec: str,
    task_spec: str,
    *,
    n_queries: int,
    group_size: int,
    feature: str = "bias",
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    split: str = "train",
    seed: int = 0,
    chunk: int = 8,
    proj_dim: int | None = None,
    device: str = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Calibrate the MEI warning threshold of ``model_spec`` before RL.

    Args:
        model_spec: model spec, meshrl run directory or ``RUN_DIR/checkpoints/step_N`` (``load_policy``).
        task_spec: task spec (``load_task``); problems of ``split`` are the calibration queries.
        n_queries: queries ``N >= 2``, a seeded sample (``random.Random(seed)``) of the split's problems.
        group_size: rollouts per query ``G`` (use the run's: MEI lives on ``[0, G]``).
        feature: ``"bias"`` or ``"head"`` (the trainer's online monitor uses ``bias``).
        max_new_tokens, temperature, top_p: sampling, as in the run; MEI uses ``softmax(logits / T)``.
        seed: seeds the task, the query sample and the sampling (chunk ``c`` uses ``seed * 1000003 + c``).
        chunk: queries per ``generate`` call.
        proj_dim: ``head`` only: TensorSketch size instead of the exact Gram (long sequences).
        device: ``auto`` | ``cpu`` | ``cuda``.
        progress: rich progress bar over queries (stderr).
    Returns:
        dict ``{mean, std, n, threshold, sigmas, std_ddof, group_size, feature, temperature, top_p,
        max_new_tokens, model, model_description, task, split, seed, n_queries, n_nan, proj_dim,
        directions_mean, g_over_mei_mean, per_query: [{problem_id, mei, directions, g_over_mei, mean_cos,
        mean_len, truncated_frac}]}``; ``n`` counts queries with a finite MEI; ``directions`` is the effective
        number of directions (participation ratio, at most G), ``g_over_mei`` the paper's G/MEI.
    """
    from meshrl.diagnostics import mean_pairwise_cosine, mei_from_gram, participation_ratio
    from meshrl.models import encode_prompt
    from meshrl.rollout import SamplingParams, eos_ids, make_backend
    from meshrl.tasks import load_task

    _check(n_queries, group_size, feature, max_new_tokens, temperature, chunk, proj_dim)
    task = load_task(task_spec, seed=seed)
    problems = task.problems(split)
    if n_queries > len(problems):
        raise ValueError(f"n_queries={n_queries} but {task_spec} split {split!r} has only {len(problems)} problems")
    chosen = random.Random(seed).sample(problems, n_queries)
    model, tok, desc = load_for_analysis(model_spec, seed=seed, device=device)
    backend = make_backend("hf", model, tok)
    pad = pad_id_of(tok, eos_ids(model, tok))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=top_p, n=group_size)
    per_query: list[dict[str, Any]] = []
    with progress_bar("mei calibrate", n_queries, progress) as advance:
        for c, start in enumerate(range(0, n_queries, chunk)):
            part = chosen[start : start + chunk]
            prompts = [encode_prompt(tok, task.format_prompt(p)) for p in part]
            ro = backend.generate(prompts, params, seed=seed * 1_000_003 + c)
            for j, problem in enumerate(part):
                rows = [i for i, k in enumerate(ro.prompt_index) if k == j]
                responses = [ro.response_ids[i] for i in rows]
                gram = query_gram(model, prompts[j], responses, pad, feature=feature, temperature=float(temperature),
                                  proj_dim=proj_dim, seed=seed)
                mei = mei_from_gram(gram)
                per_query.append({
                    "problem_id": problem.id,
                    "mei": mei,
                    "directions": participation_ratio(gram),
                    "g_over_mei": group_size / mei if mei > 0 else math.nan,
                    "mean_cos": mean_pairwise_cosine(gram),
                    "mean_len": sum(len(r) for r in responses) / len(responses),
                    "truncated_frac": sum(ro.truncated[i] for i in rows) / len(rows),
                })
                advance()
    mean, std, n = finite_stats([q["mei"] for q in per_query], ddof=STD_DDOF)
    if n < 2:
        raise ValueError(f"only {n} of {n_queries} queries gave a finite MEI; cannot calibrate")
    dirs_mean, _, _ = finite_stats([q["directions"] for q in per_query])
    g_over_mean, _, _ = finite_stats([q["g_over_mei"] for q in per_query])
    return {
        "mean": mean,
        "std": std,
        "n": n,
        "threshold": mean + SIGMAS * std,
        "sigmas": SIGMAS,
        "std_ddof": STD_DDOF,
        "group_size": group_size,
        "feature": feature,
        "proj_dim": proj_dim,
        "temperature": float(temperature),
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "model": str(model_spec),
        "model_description": desc,
        "task": task_spec,
        "split": split,
        "seed": seed,
        "n_queries": n_queries,
        "n_nan": n_queries - n,
        "directions_mean": dirs_mean,
        "g_over_mei_mean": g_over_mean,
        "per_query": per_query,
    }
