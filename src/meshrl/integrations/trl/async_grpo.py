"""Coach Prompting's reward for TRL 1.16's experimental ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``).

That trainer is not a ``GRPOTrainer``: a rollout worker, spawned as a CUDA-free child process, generates on a vLLM
server, scores each prompt row's ``num_generations`` completions with the reward functions and computes their
advantages; the trainer only trains on the scored samples. So ``MeshGRPOTrainer`` and ``MEICallback`` do not apply
(``MEICallback.attach`` refuses it), while ``HealthCallback`` attaches as to any trainer (docs/scale-out.md,
"Asynchronous trainers"). Coach Prompting without balancing carries over through the data: the rows of ``meshrl
export trl --layout query_prefix`` hold one query x prefix each, with the prompt already conditioned, so the
worker's group of a row is a prefix group.

The worker pickles its reward functions into the child and refuses closures, which
:func:`meshrl.integrations.trl.reward.task_reward_func` returns. :class:`TaskReward` is the same scorer as a
picklable object. Does not import trl.
"""

from __future__ import annotations

from typing import Any

from meshrl.integrations.trl.reward import task_reward_func


class TaskReward:
    """``task_reward_func(task_spec, split=..., seed=...)`` as a picklable callable, named ``correct``.

    The task is loaded here, so a bad spec fails in the trainer's process. A pickled copy (the worker's child
    process) reloads it on its first call.
    """

    def __init__(self, task_spec: str, *, split: str = "train", seed: int = 0) -> None:
        self.task_spec, self.split, self.seed = task_spec, split, seed
        self.__name__ = "correct"  # TRL names the reward metric after it (rewards/correct)
        self._score = task_reward_func(task_spec, split=split, seed=seed)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_score": None}

    def __call__(self, completions: list[Any], query_id: list[Any], **kwargs: Any) -> list[float]:
        if self._score is None:
            self._score = task_reward_func(self.task_spec, split=self.split, seed=self.seed)
        return self._score(completions, query_id, **kwargs)
