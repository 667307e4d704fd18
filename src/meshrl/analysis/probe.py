"""Strategy accessibility probe: can the policy still use, and would it still propose, each coach strategy?

For every problem with coach prefixes (``load_prefixes`` keyed by ``query_key(problem.prompt)``;
problems without prefixes are skipped and counted) and every strategy index ``k``:

- **accuracy**: ``n`` samples conditioned on prefix ``k`` in the Mesh placement (``system``:
  ``encode_prompt(tok, text, system=wrap_prefix(prefix, "system"))``, as the paper's release and the
  trainer's default; ``assistant``: the wrapped prefix starts the assistant turn), a sample is correct
  when ``task.score >= 1 - 1e-6``;
- **prefix log-probability**: ``log pi(prefix | Q)`` of the raw prefix text as the start of the assistant
  turn under the *unconditioned* prompt: prompt ``encode_prompt(tok, text)``, "response"
  ``tokenizer.encode(prefix, add_special_tokens=False)``, summed over its tokens and per token, with
  ``log softmax(logits / T)`` at the sampling temperature (``T = 0`` counts as 1).

With ``baseline`` the unconditioned accuracy is reported too. Run on successive checkpoints
(``RUN_DIR/checkpoints/step_N``), falling accuracy or prefix log-probability marks a strategy that RL made
inaccessible. Strategy ``k`` means "the k-th prefix of each problem": meaningful across problems when the
coach lists its strategies in a stable order (the rule coaches of the built-in tasks do).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshrl.analysis._common import finite_stats, load_for_analysis, pad_id_of, progress_bar, sequence_logprobs

PLACEMENTS = ("system", "assistant")


def _check(n: int, limit: int | None, max_new_tokens: int, temperature: float, chunk: int, placement: str) -> None:
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if limit is not None and not (isinstance(limit, int) and limit >= 1):
        raise ValueError(f"limit must be None or an integer >= 1, got {limit!r}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (isinstance(temperature, int | float) and temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


def _load_table(prefixes_path: str | Path) -> dict[str, list[str]]:
    from meshrl.mesh import load_prefixes

    path = Path(prefixes_path)
    if not path.is_file():
        raise ValueError(f"prefixes file {path}: no such file")
    return load_prefixes(path)


def _strategy_summary(k: int, rows: list[dict[str, Any]], example: str | None) -> dict[str, Any]:
    acc = [r["accuracy"][k] for r in rows if k < len(r["accuracy"])]
    solved = [r["solved"][k] for r in rows if k < len(r["solved"])]
    lps = [r["logp_sum"][k] for r in rows if k < len(r["logp_sum"])]
    lpt = [r["logp_per_token"][k] for r in rows if k < len(r["logp_per_token"])]
    ntok = [r["prefix_tokens"][k] for r in rows if k < len(r["prefix_tokens"])]
    return {
        "strategy": k,
        "n_problems": len(acc),
        "accuracy": finite_stats(acc)[0],
        "accuracy_std_over_problems": finite_stats(acc)[1],
        "solved_frac": finite_stats(solved)[0],
        "logp_sum_mean": finite_stats(lps)[0],
        "logp_per_token_mean": finite_stats(lpt)[0],
        "prefix_tokens_mean": finite_stats(ntok)[0],
        "example": example,
    }


def probe(
    model_spec: str,
    task_spec: str,
    prefixes_path: str | Path,
    *,
    n: int,
    split: str = "train",
    limit: int | None = None,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    chunk: int = 4,
    placement: str = "system",
    baseline: bool = True,
    device: str = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Per-strategy accuracy and prefix log-probability of ``model_spec`` (see the module docstring).

    Args:
        model_spec: model spec, run directory or ``RUN_DIR/checkpoints/step_N`` (``load_policy``).
        task_spec: task spec; its ``split`` problems (the first ``limit``) are probed.
        prefixes_path: prefix cache written by ``meshrl coach`` / ``meshrl.mesh.generate_prefixes``.
        n: samples per (problem, strategy).
        max_new_tokens, temperature, top_p: sampling; seed: task seed and sampling seed (chunk ``c`` of
            problems uses ``seed * 1000003 + c``).
        chunk: problems per ``generate`` call (each contributes ``m (+1)`` prompts of ``n`` samples).
        placement: ``system`` (default) or ``assistant``; baseline: also sample without any prefix.
        device: ``auto`` | ``cpu`` | ``cuda``. progress: rich bar over problems (stderr).
    Returns:
        dict with the settings, ``problems_total``, ``problems_used``, ``problems_skipped_no_prefix``,
        ``m`` (most prefixes of a problem), ``strategies`` (``[{strategy, n_problems, accuracy,
        accuracy_std_over_problems, solved_frac, logp_sum_mean, logp_per_token_mean, prefix_tokens_mean,
        example}]``), ``baseline`` (``{accuracy, solved_frac, n_problems}`` or ``None``) and ``per_problem``
        (``[{problem_id, accuracy, solved, logp_sum, logp_per_token, prefix_tokens, baseline_accuracy}]``,
        lists indexed by strategy).
    """
    from meshrl.mesh import query_key
    from meshrl.rewards import RewardRunner
    from meshrl.rollout import SamplingParams, eos_ids, make_backend
    from meshrl.tasks import load_task

    _check(n, limit, max_new_tokens, temperature, chunk, placement)
    table = _load_table(prefixes_path)
    task = load_task(task_spec, seed=seed)
    problems = task.problems(split)
    problems = problems[:limit] if limit else problems
    if not problems:
        raise ValueError(f"{task_spec} split {split!r} has no problems")
    used = [(p, table[query_key(p.prompt)]) for p in problems if table.get(query_key(p.prompt))]
    if not used:
        raise ValueError(f"prefixes file {prefixes_path}: none of the {len(problems)} problems of {task_spec} "
                         f"split {split!r} has prefixes (keys are query_key(problem.prompt))")
    model, tok, desc = load_for_analysis(model_spec, seed=seed, device=device)
    backend = make_backend("hf", model, tok)
    pad = pad_id_of(tok, eos_ids(model, tok))
    runner = RewardRunner(task.score, timeout_s=10.0)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=top_p, n=n)
    sample = _sampler(tok, task, backend, runner, params, placement)
    per_problem: list[dict[str, Any]] = []
    with progress_bar("probe", len(used), progress) as advance:
        for c, start in enumerate(range(0, len(used), chunk)):
            part = used[start : start + chunk]
            acc, solved, base = sample(part, baseline, seed * 1_000_003 + c)
            for j, (problem, prefixes) in enumerate(part):
                plain = encode_user(tok, task.format_prompt(problem))
                prefix_ids = [list(tok.encode(x, add_special_tokens=False)) for x in prefixes]
                lp_sum, ntok = sequence_logprobs(model, [plain] * len(prefixes), prefix_ids, pad, float(temperature))
                per_problem.append({
                    "problem_id": problem.id,
                    "accuracy": acc[j],
                    "solved": solved[j],
                    "logp_sum": lp_sum.tolist(),
                    "logp_per_token": [float(s) / max(float(t), 1.0) for s, t in zip(lp_sum, ntok, strict=True)],
                    "prefix_tokens": [int(t) for t in ntok],
                    "baseline_accuracy": base[j],
                })
                advance()
    m = max(len(x) for _, x in used)
    strategies = [_strategy_summary(k, per_problem, next((x[k] for _, x in used if k < len(x)), None))
                  for k in range(m)]
    base_acc = [r["baseline_accuracy"] for r in per_problem if r["baseline_accuracy"] is not None]
    return {
        "model": str(model_spec),
        "model_description": desc,
        "task": task_spec,
        "split": split,
        "prefixes": str(prefixes_path),
        "n": n,
        "temperature": float(temperature),
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "placement": placement,
        "problems_total": len(problems),
        "problems_used": len(used),
        "problems_skipped_no_prefix": len(problems) - len(used),
        "m": m,
        "strategies": strategies,
        "baseline": ({"accuracy": finite_stats(base_acc)[0], "n_problems": len(base_acc),
                      "solved_frac": finite_stats([float(a > 0) for a in base_acc])[0]} if baseline else None),
        "per_problem": per_problem,
    }


def encode_user(tok: Any, text: str, *, system: str | None = None, assistant_prefix: str | None = None) -> list[int]:
    """:func:`meshrl.models.encode_prompt` (imported lazily)."""
    from meshrl.models import encode_prompt

    return encode_prompt(tok, text, system=system, assistant_prefix=assistant_prefix)


Sampler = Callable[[list, bool, int], tuple[list[list[float]], list[list[float]], list[float | None]]]


def _sampler(tok: Any, task: Any, backend: Any, runner: Any, params: Any, placement: str) -> Sampler:
    """``sample(part, baseline, seed) -> (accuracy[j][k], solved[j][k], baseline_accuracy[j])``."""
    from meshrl.mesh import wrap_prefix
    from meshrl.runs.correct import is_correct

    def prompt(problem: Any, prefix: str | None) -> list[int]:
        text = task.format_prompt(problem)
        if prefix is None:
            return encode_user(tok, text)
        wrapped = wrap_prefix(prefix, placement)
        if placement == "system":
            return encode_user(tok, text, system=wrapped)
        return encode_user(tok, text, assistant_prefix=wrapped)

    def sample(part: list, baseline: bool, seed: int):
        arms = [(j, k) for j, (_, prefixes) in enumerate(part) for k in range(len(prefixes))]
        if baseline:
            arms += [(j, -1) for j in range(len(part))]
        prompts = [prompt(part[j][0], None if k < 0 else part[j][1][k]) for j, k in arms]
        ro = backend.generate(prompts, params, seed=seed)
        probs = [part[arms[i][0]][0] for i in ro.prompt_index]
        scores = runner(ro.texts, probs)
        hits: dict[tuple[int, int], list[float]] = {}
        for i, s in zip(ro.prompt_index, scores, strict=True):
            hits.setdefault(arms[i], []).append(float(is_correct(s)))
        acc = [[sum(hits[(j, k)]) / len(hits[(j, k)]) for k in range(len(x))] for j, (_, x) in enumerate(part)]
        solved = [[float(a > 0) for a in row] for row in acc]
        base = [sum(hits[(j, -1)]) / len(hits[(j, -1)]) if baseline else None for j in range(len(part))]
        return acc, solved, base

    return sample
