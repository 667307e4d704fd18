"""``plugins.replay``: each batch of rollouts trained on at ``1 + reuse_steps`` consecutive steps, against the
log-probs of the policy that sampled it (the stale-rollout setting M2PO is made for).

A fresh batch is stored with the step it was sampled at; its behaviour log-probs are scored at the start of its
first update, before any optimiser step moves the policy. A reused batch logs ``rollouts/count`` 0 and its age
(``replay/age``). The buffer is in the checkpoint's ``state.json``: a resume that dropped it would start a new
replay cycle, and the resumed run would train on other rollouts than the uninterrupted one, without a word.

Everything is stored exactly: tensors as nested lists with their dtype (a float32 or bfloat16 value is a float64
exactly, and Python writes floats as the shortest text that reads back to the same value); problems by their id,
looked up in the task's training problems on restore (an id that is no longer there raises ``ValueError``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, register


@dataclass
class ReplayConfig:
    reuse_steps: int = setting(0, ge=0, help="S: new rollouts every S + 1 steps, each batch reused S times (0 = off)")


@register
class Replay(Plugin):
    name = "replay"
    Config = ReplayConfig
    stage = Stage.SAMPLING
    order = 2.0
    token_level = False
    summary = "rollout replay: each batch reused S times against its sampling policy"

    def __init__(self, cfg: ReplayConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        # (the batch, its behaviour log-probs (scored at its first update), the step it was sampled at)
        self.stored: tuple[Any, list[torch.Tensor] | None, int] | None = None

    @classmethod
    def is_enabled(cls, cfg: ReplayConfig) -> bool:
        return cfg.reuse_steps > 0

    def reuse_batch(self, step: int, cursor: int) -> tuple[Any, int] | None:
        if self.stored is None or step - self.stored[2] > self.cfg.reuse_steps:
            return None
        data, _, born = self.stored
        stats = {**data.stats, "rollouts/count": 0.0, "time/rollout_s": 0.0, "replay/age": float(step - born)}
        return dataclasses.replace(data, stats=stats), cursor

    def after_sampling(self, step: int, data: Any, sampler: Any) -> Any:
        data.stats["replay/age"] = 0.0
        return data

    def batch_ready(self, step: int, data: Any) -> None:
        # Stored once every plug-in's after_sampling ran (LUFFY's traces and coach_guide's openings sit in later
        # stages): the reused batch is the one the first update trained on.
        self.stored = (data, None, step)

    def behaviour_logps(self, data: Any, old_logps: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """A reused batch's ratio is against the policy that sampled it; a fresh one's is the update's own (its
        log-probs are scored now, before the first optimiser step, for the steps that will reuse it)."""
        if self.stored is None or data.texts is not self.stored[0].texts:
            return old_logps
        stored, logps, born = self.stored
        if logps is None:
            # One extra no-grad forward per stored batch: with one optimiser step per batch the update takes its
            # old log-probs from its own forward (old_logps is None here), so nothing has scored the batch under
            # the sampling policy yet, and after this step's update that policy is gone.
            logps = self.ctx.forward.logps(self.ctx.forward.model, stored)
            self.stored = (stored, logps, born)
        return logps if data.stats.get("replay/age", 0) > 0 else old_logps

    def state_dict(self) -> dict[str, Any] | None:
        if self.stored is None:
            return {}  # nothing stored yet is a state too: None would read as "not kept" (a warning on resume)
        data, logps, born = self.stored
        if logps is None:  # an empty batch never reaches an update
            logps = self.ctx.forward.logps(self.ctx.forward.model, data)
        return replay_to_json((data, logps, born))

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            self.stored = None
            return
        by_id = {str(p.id): p for p in self.ctx.problems}
        self.stored = replay_from_json(state, by_id)

_LIST_FIELDS = ("prompt_ids", "response_ids", "texts", "truncated", "query_ids", "strategy_ids", "scores",
                "rollout_logps", "origin", "unsampled")


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
        "response_masks": list(data.response_masks),
    }


def step_data_from_json(obj: dict[str, Any], problems: dict[str, Any]) -> Any:
    """The inverse of :func:`step_data_to_json`; ``problems`` maps id -> problem."""
    from meshrl.trainer.step_data import StepData

    def problem(pid: str) -> Any:
        if pid not in problems:
            raise ValueError(f"checkpoint plug-in state: problem {pid!r} is not among the task's training problems "
                             "(was the run resumed with another task or task seed?)")
        return problems[pid]

    if "origin" not in obj:  # a checkpoint from before rows carried their provenance
        obj = {**obj, **_provenance_of_old(obj)}
    data = StepData(**{name: list(obj[name]) for name in _LIST_FIELDS})
    data.problems = [problem(pid) for pid in obj["problems"]]
    data.group_ids = [_group_from_json(g) for g in obj["group_ids"]]
    data.rewards, data.advantages = tensor_from_json(obj["rewards"]), tensor_from_json(obj["advantages"])
    data.stats = dict(obj["stats"])
    data.seen = [(text, score, problem(pid)) for text, score, pid in obj["seen"]]
    data.response_masks = list(obj.get("response_masks", []))  # absent in checkpoints from before multi-turn
    return data


def _provenance_of_old(obj: dict[str, Any]) -> dict[str, list[Any]]:
    """``origin`` / ``unsampled`` of a batch stored by an earlier version: its coach-guided rows (``forced_tokens``)
    and its off-policy trace rows (``off_rows``, beside the batch), named as those plug-ins name themselves."""
    forced = list(obj.get("forced_tokens") or [0] * len(obj["texts"]))
    off = set(obj.get("off_rows", ()))
    origin = ["luffy" if i in off else "coach_guide" if n else "" for i, n in enumerate(forced)]
    unsampled = [len(obj["response_ids"][i]) if i in off else n for i, n in enumerate(forced)]
    return {"origin": origin, "unsampled": unsampled}


def replay_to_json(replay: tuple[Any, list[torch.Tensor], int] | None) -> dict[str, Any] | None:
    if replay is None:
        return None
    data, logps, born = replay
    return {"data": step_data_to_json(data), "behaviour_logps": [tensor_to_json(t) for t in logps], "born": born}


def replay_from_json(obj: dict[str, Any] | None, problems: dict[str, Any]
                     ) -> tuple[Any, list[torch.Tensor], int] | None:
    if obj is None:
        return None
    data = obj["data"]
    if "origin" not in data:  # an earlier version kept the trace rows beside the batch
        data = {**data, "off_rows": obj.get("off_rows", [])}
    return (step_data_from_json(data, problems), [tensor_from_json(t) for t in obj["behaviour_logps"]],
            int(obj["born"]))
