"""``plugins.prompt_filter``: rollout-based prompt filtering (the reading list's RIF-RFT; docs/plugins.md).

Problems whose recent groups were all correct or all wrong teach nothing (their group advantages are 0); they are
skipped before sampling and readmitted later. The filter's state is part of the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshrl.runs.correct import is_correct
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, register


@dataclass
class PromptFilterConfig:
    enabled: bool = setting(False, help="skip problems whose recent groups were all right or all wrong (RIF-RFT)")
    window: int = setting(1, ge=1, help="skip a problem when its last `window` groups were all correct or all wrong")
    readmit_after: int = setting(5, ge=1, help="... for this many steps; then it is sampled again (history cleared)")


@register
class PromptFilter(Plugin):
    """Wraps the sampler's problem stream in :class:`FilteredProblems` before the run's first sampling."""

    name = "prompt_filter"
    Config = PromptFilterConfig
    stage = Stage.SAMPLING
    order = 1.0
    token_level = False
    summary = "rollout-based prompt filtering: skip problems that teach nothing (RIF-RFT)"

    def __init__(self, cfg: PromptFilterConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self.filter = FilteredProblems(None, ctx.problems, cfg)  # its stream comes with the first sampling

    def before_sampling(self, sampler: Any) -> None:
        if sampler.problem_stream is not self.filter:  # once: the filter reads the stream it replaces
            self.filter.inner, sampler.problem_stream = sampler.problem_stream, self.filter

    def after_sampling(self, step: int, data: Any, sampler: Any) -> Any:
        data.stats.update(self.filter.record(step, data.seen))
        return data

    def state_dict(self) -> dict[str, Any]:
        return self.filter.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.filter.load_state_dict(state)


class FilteredProblems:
    """The sampler's problem stream with RIF-RFT's filter: cursor position ``p`` maps to the ``p``-th problem
    of the underlying stream that is not skipped when it comes up. A problem is skipped while its last
    ``window`` groups were all correct or all wrong (it teaches nothing: its advantages are 0), until
    ``readmit_after`` steps have passed since its last group; then its history is cleared and it is sampled
    again. A position, once mapped, keeps its problem. The filter's state is in the checkpoint (:meth:`state_dict`)."""

    def __init__(self, inner: Any, problems: list[Any], cfg: PromptFilterConfig) -> None:
        self.inner, self.problems, self.cfg = inner, problems, cfg
        self.n = len(problems)
        self._mapped: dict[int, int] = {}  # cursor position -> problem index, filled in order
        self._next = 0  # next position of the underlying stream
        self._history: dict[str, list[bool]] = {}  # problem id -> uniform (all right / all wrong) per group
        self._last_seen: dict[str, int] = {}
        self._step = 0
        self._skipped_now = 0

    def state_dict(self) -> dict[str, Any]:
        return {"mapped": [self._mapped[k] for k in range(len(self._mapped))], "next": self._next,
                "history": self._history, "last_seen": self._last_seen, "step": self._step,
                "skipped_now": self._skipped_now}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._mapped = dict(enumerate(int(i) for i in state["mapped"]))
        self._next, self._step, self._skipped_now = int(state["next"]), int(state["step"]), int(state["skipped_now"])
        self._history = {str(k): [bool(x) for x in v] for k, v in state["history"].items()}
        self._last_seen = {str(k): int(v) for k, v in state["last_seen"].items()}

    def index(self, cursor: int) -> int:
        while cursor not in self._mapped:
            self._mapped[len(self._mapped)] = self._admit()
        return self._mapped[cursor]

    def _admit(self) -> int:
        for _ in range(self.n):  # at most one pass over the problems, then admit anyway
            i = self.inner.index(self._next)
            self._next += 1
            if not self._skip(str(self.problems[i].id)):
                return i
            self._skipped_now += 1
        i = self.inner.index(self._next)
        self._next += 1
        return i

    def _skip(self, pid: str) -> bool:
        h = self._history.get(pid, [])
        if len(h) < self.cfg.window or not all(h[-self.cfg.window:]):
            return False
        if self._step - self._last_seen[pid] >= self.cfg.readmit_after:
            self._history.pop(pid)  # readmitted: judged again on its next groups
            return False
        return True

    def record(self, step: int, seen: list[tuple[str, float, Any]]) -> dict[str, float]:
        """Log the step's groups (every sampled rollout, before any dynamic-sampling drop); return
        ``filter/skipped`` (problems skipped while this step was sampled) and ``filter/skipped_frac``."""
        groups: dict[str, list[bool]] = {}
        for _, score, problem in seen:
            groups.setdefault(str(problem.id), []).append(is_correct(score))
        for pid, correct in groups.items():
            self._history.setdefault(pid, []).append(all(correct) or not any(correct))
            self._last_seen[pid] = step
        skipped, self._skipped_now = self._skipped_now, 0
        self._step = step + 1
        admitted = len(groups)
        return {"filter/skipped": float(skipped), "filter/skipped_frac": skipped / max(skipped + admitted, 1)}
