"""Tool use per problem type on ``testbed:tools``: how often a policy calls the calculator, and how often each
pattern is right.

:func:`tool_report` samples ``n`` episodes per problem (temperature 1, as the trainer samples) and returns, per
type and over all problems: ``tool_share`` (episodes labelled ``calculator`` / labelled episodes), ``accuracy``
(strict reward), ``acc_tool`` and ``acc_direct`` (accuracy of the episodes of each pattern; ``None`` when the
policy never used that pattern on the type), ``unlabelled`` (episodes whose tool markup the strict parser
refused) and ``n`` (episodes). ``calls_on_niche`` in the docstring sense is ``report["mul"]["tool_share"]``.
"""

from __future__ import annotations

from typing import Any

from meshrl.testbed.tools_task import TOOL_NAME, TYPES, ToolsTestbed


def tool_report(model: Any, tokenizer: Any, task: ToolsTestbed, problems: list[Any], *, n: int = 4, seed: int = 0,
                backend: str = "hf", batch_size: int = 64) -> dict[str, dict[str, float | int | None]]:
    """The per-type figures of the module docstring for ``problems`` (``n`` episodes each, seeded)."""
    from meshrl.agents import run_episodes
    from meshrl.rollout import SamplingParams, make_backend
    from meshrl.trainer import transcript

    if n < 1 or not problems:
        raise ValueError(f"tool_report needs problems and n >= 1, got {len(problems)} problems, n={n}")
    engine = make_backend(backend, model, tokenizer)
    params = SamplingParams(max_new_tokens=task.max_new_tokens, temperature=1.0, n=n)
    rows: list[tuple[str, str | None, float]] = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start: start + batch_size]
        prompts = [task.encode_prompt(tokenizer, task.format_prompt(p)) for p in chunk]
        episodes = run_episodes(engine, prompts, None, tokenizer, params, task.limits, seed + start,
                                tools=task.tools, tool_workers=1)
        for episode in episodes:
            problem = chunk[episode.prompt_index]
            label = task.label_strategy(transcript(tokenizer, episode))
            rows.append((problem.meta["type"], label, task.score(episode.final_text, problem)))
    return {kind: _figures([r for r in rows if kind == "all" or r[0] == kind]) for kind in (*TYPES, "all")}


def _figures(rows: list[tuple[str, str | None, float]]) -> dict[str, float | int | None]:
    labelled = [r for r in rows if r[1] is not None]
    tool = [r[2] for r in labelled if r[1] == TOOL_NAME]
    direct = [r[2] for r in labelled if r[1] == "direct"]
    return {"n": len(rows), "accuracy": _mean([r[2] for r in rows]),
            "tool_share": len(tool) / len(labelled) if labelled else None,
            "acc_tool": _mean(tool), "acc_direct": _mean(direct),
            "unlabelled": (len(rows) - len(labelled)) / len(rows) if rows else None}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
