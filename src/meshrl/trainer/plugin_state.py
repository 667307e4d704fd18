"""The plug-ins' state that lives across steps, as JSON for the checkpoint's ``state.json``.

Two plug-ins carry state from one step to the next: ``plugins.replay`` (the stored batch of rollouts, the
behaviour log-probs it was sampled under, its off-policy rows and the step it was sampled at) and
``plugins.prompt_filter`` (which cursor position maps to which problem, each problem's recent groups). A resume
that dropped them would start a new replay cycle and forget the filter's history: the resumed run would train
on other rollouts than the uninterrupted one, without a word. So the checkpoint keeps them, and a resumed run
continues sample for sample (``tests/test_trainer_plugins.py``).

Everything is stored exactly: tensors as nested lists with their dtype (a float32 or bfloat16 value is a float64
exactly, and Python writes floats as the shortest text that reads back to the same value); problems by their id,
looked up in the task's training problems on restore (an id that is no longer there raises ``ValueError``).
"""

from __future__ import annotations

from typing import Any

import torch

_LIST_FIELDS = ("prompt_ids", "response_ids", "texts", "truncated", "query_ids", "strategy_ids", "scores",
                "rollout_logps", "forced_tokens")


def tensor_to_json(t: torch.Tensor | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "values": t.detach().float().cpu().reshape(-1).tolist()}


def tensor_from_json(obj: dict[str, Any] | None) -> torch.Tensor | None:
    if obj is None:
        return None
    t = torch.tensor(obj["values"], dtype=torch.float32).reshape(obj["shape"])
    return t.to(getattr(torch, obj["dtype"]))


def _group_to_json(g: Any) -> Any:
    return list(g) if isinstance(g, tuple) else g


def _group_from_json(g: Any) -> Any:
    return tuple(g) if isinstance(g, list) else g


def step_data_to_json(data: Any) -> dict[str, Any]:
    """A :class:`~meshrl.trainer.rollout_step.StepData` as JSON (problems by id)."""
    return {
        **{name: list(getattr(data, name)) for name in _LIST_FIELDS},
        "problems": [str(p.id) for p in data.problems],
        "group_ids": [_group_to_json(g) for g in data.group_ids],
        "rewards": tensor_to_json(data.rewards), "advantages": tensor_to_json(data.advantages),
        "stats": dict(data.stats),
        "seen": [[text, score, str(p.id)] for text, score, p in data.seen],
    }


def step_data_from_json(obj: dict[str, Any], problems: dict[str, Any]) -> Any:
    """The inverse of :func:`step_data_to_json`; ``problems`` maps id -> problem."""
    from meshrl.trainer.rollout_step import StepData

    def problem(pid: str) -> Any:
        if pid not in problems:
            raise ValueError(f"checkpoint plug-in state: problem {pid!r} is not among the task's training problems "
                             "(was the run resumed with another task or task seed?)")
        return problems[pid]

    data = StepData(**{name: list(obj[name]) for name in _LIST_FIELDS})
    data.problems = [problem(pid) for pid in obj["problems"]]
    data.group_ids = [_group_from_json(g) for g in obj["group_ids"]]
    data.rewards, data.advantages = tensor_from_json(obj["rewards"]), tensor_from_json(obj["advantages"])
    data.stats = dict(obj["stats"])
    data.seen = [(text, score, problem(pid)) for text, score, pid in obj["seen"]]
    return data


def replay_to_json(replay: tuple[Any, list[torch.Tensor], set[int], int] | None) -> dict[str, Any] | None:
    if replay is None:
        return None
    data, logps, off_rows, born = replay
    return {"data": step_data_to_json(data), "behaviour_logps": [tensor_to_json(t) for t in logps],
            "off_rows": sorted(off_rows), "born": born}


def replay_from_json(obj: dict[str, Any] | None, problems: dict[str, Any]
                     ) -> tuple[Any, list[torch.Tensor], set[int], int] | None:
    if obj is None:
        return None
    return (step_data_from_json(obj["data"], problems), [tensor_from_json(t) for t in obj["behaviour_logps"]],
            set(obj["off_rows"]), int(obj["born"]))
