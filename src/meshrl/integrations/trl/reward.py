"""The TRL reward function of a task: completions scored with the task's own scorer, by the ``query_id`` column that
``meshrl export trl`` (:mod:`meshrl.export.trl`) writes. Does not import trl."""

from __future__ import annotations


def task_reward_func(task_spec: str, *, split: str = "train", seed: int = 0):
    """A TRL reward function scoring completions with the task's own scorer, looked up by ``query_id``.

    The returned ``fn(completions, query_id, **kwargs) -> list[float]`` reads the ``query_id`` column
    written by ``meshrl export trl``; conversational completions are scored on their first message's text.
    Its ``__name__`` is ``correct`` (the metric ``rewards/correct/mean`` and ``MeshOptions.correct_reward``).
    """
    from meshrl.tasks import load_task

    task = load_task(task_spec, seed=seed)
    by_id = {str(p.id): p for p in task.problems(split)}

    def correct(completions, query_id, **kwargs) -> list[float]:
        if len(completions) != len(query_id):
            raise ValueError(f"reward: {len(completions)} completions but {len(query_id)} query ids; the dataset's "
                             "'query_id' column (from `meshrl export trl`) must give one id per completion")
        scores = []
        for completion, qid in zip(completions, query_id, strict=True):
            text = completion if isinstance(completion, str) else completion[0]["content"]
            if str(qid) not in by_id:
                raise ValueError(f"reward: query_id {qid!r} is not a problem of task {task_spec} split {split!r}")
            scores.append(float(task.score(text, by_id[str(qid)])))
        return scores

    return correct
