"""Reward function for verl: meshrl's own scorer for the rows written by ``meshrl export verl`` (no verl import).

verl's default reward manager (``naive``, 0.9.1) calls
``compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)`` per rollout, with the
dataset row's ``extra_info``; a dict return puts ``score`` in the reward and every other key in
``reward_extra_info``. :class:`TaskScorer` scores a completion exactly as meshrl's trainer does: the task's own
``score(completion, problem)`` on the problem named by ``extra_info["query_id"]`` (tasks may grade beyond the
reference string: dense rewards, code execution, reasoning-gym's scorers) under meshrl's reward rules
(:class:`meshrl.rewards.RewardRunner`: a time limit, an exception, a NaN or a non-number scores 0 and is logged,
a score outside [0, 1] is clamped), so that one bad completion neither crashes verl's reward worker nor hands it
a NaN. The scorer runs in this process (``isolation="inline"``: no fork inside verl's worker, and no lock when
verl scores from several threads); its time limit then holds in the main thread only. The task is loaded once
per process.
The export writes a small module that builds one (``reward.py`` next to the parquet files); point verl's
``reward.custom_reward_function.path`` at it, ``name=compute_score``.
"""

from __future__ import annotations

from typing import Any

from meshrl.rewards import RewardRunner
from meshrl.runs.correct import is_correct  # "acc" as meshrl's trainer counts a rollout correct
from meshrl.tasks import load_task


class TaskScorer:
    """``compute_score`` for verl, bound to the task (spec and seed) the data was exported from."""

    def __init__(self, task: str, seed: int = 0, timeout_s: float | None = 10.0, isolation: str = "inline") -> None:
        self.task_spec, self.seed, self.timeout_s, self.isolation = task, seed, timeout_s, isolation
        self._task: Any = None
        self._runner: RewardRunner | None = None
        self._problems: dict[str, dict[str, Any]] = {}

    def problem(self, query_id: str, split: str) -> tuple[Any, Any]:
        """``(task, problem)`` for a row; ``ValueError`` naming the id when the task has no such problem."""
        if self._task is None:
            self._task = load_task(self.task_spec, seed=self.seed)
        if split not in self._problems:
            self._problems[split] = {p.id: p for p in self._task.problems(split)}
        found = self._problems[split].get(query_id)
        if found is None:
            raise ValueError(f"reward: query_id {query_id!r} is not a {split} problem of task {self.task_spec!r} "
                             f"(seed {self.seed}); re-export the data with `meshrl export verl`")
        return self._task, found

    def __call__(self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                 **_: Any) -> dict[str, Any]:
        """``{"score": s in [0, 1], "acc": s reached 1}`` for one completion (keyword arguments as verl passes)."""
        info = extra_info or {}
        if info.get("query_id") is None or info.get("split") is None:
            raise ValueError(f"reward: a row of {data_source!r} has no extra_info 'query_id'/'split'; "
                             "was it written by `meshrl export verl`?")
        task, problem = self.problem(str(info["query_id"]), str(info["split"]))
        if self._runner is None:
            self._runner = RewardRunner(task.score, timeout_s=self.timeout_s, isolation=self.isolation)
        score = self._runner.score_one(solution_str, problem)
        return {"score": score, "acc": is_correct(score)}
