"""``rg:NAME``: any reasoning-gym dataset as a task.

``rg:NAME?key=value&...`` passes ``key=value`` (coerced to int/float/bool/JSON list) to the
dataset's config; meshrl's own options are ``size`` (train problems, default 256), ``eval_size``
(held-out problems, default 64) and ``instruction``.

The train split is entries ``0..size-1`` of ``reasoning_gym.create_dataset(NAME, seed=seed,
size=size+eval_size)``; the eval split is the remaining entries minus any whose question also
occurs in the train split, so the two are disjoint.  Each problem keeps its entry in
``meta["entry"]`` because the dataset's own scorer needs it.  Scoring extracts the final answer
strictly (``meshrl.rewards.extract_answer``; no extractable answer gives 0.0, the raw completion
is never scored) and applies ``dataset.score_answer(answer, entry)``.
"""

from __future__ import annotations

from typing import Any

from meshrl.errors import MissingDependency
from meshrl.tasks._spec import int_option
from meshrl.tasks.base import Problem, StaticTask, register_task_prefix

RG_INSTRUCTION = (
    "Give your final answer inside <answer>...</answer> tags, or within \\boxed{}, "
    "and nothing else inside them."
)
_OWN_OPTIONS = {"size": 256, "eval_size": 64, "instruction": RG_INSTRUCTION}


def _create_dataset(name: str, seed: int, size: int, config: dict[str, Any]):
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency("rg: tasks need reasoning-gym: pip install 'meshrl[tasks]'") from exc
    if name not in DATASETS:
        near = [known for known in sorted(DATASETS) if name.lower() in known.lower()]
        examples = near[:10] or sorted(DATASETS)[:8]
        hint = f"; {'similar' if near else 'for example'}: {', '.join(examples)}"
        raise ValueError(f"unknown reasoning-gym dataset {name!r}{hint}")
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except (TypeError, AssertionError, ValueError) as exc:
        raise ValueError(f"rg:{name}: invalid dataset options {config}: {exc}") from exc


def _entry_problem(name: str, index: int, entry: dict[str, Any]) -> Problem:
    return Problem(
        id=f"{name}-{index}",
        prompt=str(entry["question"]),
        answer=str(entry["answer"]),
        meta={"entry": entry, "dataset": name, "index": index, "metadata": entry.get("metadata") or {}},
    )


class ReasoningGymTask(StaticTask):
    """A reasoning-gym procedural dataset scored by the dataset's own ``score_answer``."""

    reward_kind = "custom"

    def __init__(self, dataset_name: str, *, seed: int = 0, **options: Any) -> None:
        own = {key: options.pop(key, default) for key, default in _OWN_OPTIONS.items()}
        name = f"rg:{dataset_name}"
        size = int_option(name, "size", own["size"], minimum=1)
        eval_size = int_option(name, "eval_size", own["eval_size"], minimum=0)
        self.dataset_name = dataset_name
        self.config = dict(options)
        self.dataset = _create_dataset(dataset_name, seed, size + eval_size, self.config)
        train = [_entry_problem(dataset_name, i, self.dataset[i]) for i in range(size)]
        seen = {p.prompt for p in train}
        held = []
        for i in range(size, size + eval_size):
            problem = _entry_problem(dataset_name, i, self.dataset[i])
            if problem.prompt not in seen:
                held.append(problem)
                seen.add(problem.prompt)
        super().__init__(f"rg:{dataset_name}", {"train": train, "eval": held}, instruction=own["instruction"])

    def score(self, completion: str, problem: Problem) -> float:
        """The dataset's own score of the strictly extracted answer, clipped to ``[0, 1]``."""
        from meshrl.rewards import extract_answer

        answer = extract_answer(completion)
        if answer is None:
            return 0.0
        value = float(self.dataset.score_answer(answer.strip(), problem.meta["entry"]))
        return min(max(value, 0.0), 1.0)


@register_task_prefix("rg", "rg:NAME")
def _rg_task(name: str, *, seed: int = 0, **options: Any) -> ReasoningGymTask:
    return ReasoningGymTask(name, seed=seed, **options)
