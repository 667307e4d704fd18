"""Task/Problem contract, the task registry and ``load_task``.

A :class:`Task` is a named, deterministic collection of :class:`Problem` objects split into
``train``/``eval`` (and ``all``) plus a scorer that maps a model completion to a reward in ``[0, 1]``.

Tasks are created from a *spec* string by :func:`load_task`:

* a registered built-in name (``tiny:add``, ``tiny:repeat``, ``math500``, ``gsm8k``),
* a prefix form: ``rg:NAME``, ``jsonl:PATH``, ``parquet:PATH``.

Any spec may carry options as a query string, ``SPEC?key=value&key=value``; values are coerced to
``int``/``float``/``bool``/JSON lists where they parse as such.  Keyword options given to
:func:`load_task` override options from the query string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from meshrl.tasks._spec import int_option, split_spec

BOXED_INSTRUCTION = "Put your final answer within \\boxed{}."
LAST_NUMBER_INSTRUCTION = "End your reply with the final answer as a number."
REWARD_KINDS = ("math", "number", "last_number", "choice", "exact", "custom")
#: The answer-format instruction a file task (``jsonl:``, ``parquet:``) appends to every prompt unless
#: ``instruction=`` is given: the strict kinds need a ``\\boxed{}`` (or ``<answer>``, or "the answer is")
#: statement, ``last_number`` only a number at the end.
DEFAULT_INSTRUCTIONS: dict[str, str] = {"math": BOXED_INSTRUCTION, "number": BOXED_INSTRUCTION,
                                        "choice": BOXED_INSTRUCTION, "exact": BOXED_INSTRUCTION,
                                        "last_number": LAST_NUMBER_INSTRUCTION}

TaskFactory = Callable[..., "Task"]
PrefixFactory = Callable[..., "Task"]

_BUILTINS: dict[str, TaskFactory] = {}
_PREFIXES: dict[str, tuple[PrefixFactory, str]] = {}
_SPEC_LOADERS: dict[str, TaskFactory] = {}


@dataclass(frozen=True)
class Problem:
    """One problem of a task.

    ``prompt`` is the bare question (no answer-format instruction); ``answer`` is the reference
    answer as a string; ``meta`` holds task-specific data (source row, reasoning-gym entry, ...).
    """

    id: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


class Task:
    """Base class of all tasks.

    Subclasses set ``name``, ``reward_kind``, ``instruction`` and ``splits`` and implement
    :meth:`problems`; :meth:`score` defaults to ``meshrl.rewards.grade`` with ``reward_kind``.

    Hooks the trainer calls for coached training (Mesh / CP, ``plugins.coach_guide``); the defaults keep a task
    that knows nothing of coaching correct, and a task with labelled procedures (the collapse testbed,
    ``docs/testbed.md``) overrides them:

    * :meth:`coach_strategies`: the rule coach's prefixes for a problem (default ``None``: a model coach is needed).
    * :meth:`label_strategy`: which known procedure a completion follows (default ``None``).
    * :meth:`conditioned_score`: the reward of a rollout sampled under a coach prefix (default: its score,
      unchanged), e.g. a reward that asks the rollout to follow its prefix.
    * :meth:`response_opening`: the text a coach-guided response is forced to start with (default: the coach
      prefix as the response's first line, ``prefix + "\\n"``).
    """

    name: str = "task"
    reward_kind: str = "exact"
    instruction: str | None = BOXED_INSTRUCTION
    splits: tuple[str, ...] = ("train",)

    def problems(self, split: str = "train") -> list[Problem]:
        """Return the problems of ``split`` (deterministic for a given seed and options)."""
        raise NotImplementedError

    def score(self, completion: str, problem: Problem) -> float:
        """Reward in ``[0, 1]`` for ``completion`` graded against ``problem.answer``."""
        from meshrl.rewards import grade

        return float(grade(completion, problem.answer, self.reward_kind))

    strategies: tuple[str, ...] = ()  # names of known solution procedures (tasks with labelled traces)

    def label_strategy(self, completion: str) -> str | None:
        """The procedure a completion follows (one of :attr:`strategies`), or ``None``: a parser of the
        trace, for tasks whose strategies are machine-recognisable (the collapse testbed)."""
        return None

    def coach_strategies(self, problem: Problem) -> list[str] | None:
        """Known solution strategies for ``problem`` (the rule coach's prefixes), or ``None``.

        Built-in tasks whose methods are known override this; tasks without it need a model coach
        (``meshrl coach --backend openai|hf``).
        """
        return None

    def conditioned_score(self, score: float, completion: str, problem: Problem, prefix: str) -> float:
        """The reward of ``completion``, sampled for ``problem`` under coach ``prefix`` and scored ``score`` by
        :meth:`score`. Unconditioned rollouts are never passed here. Default: ``score`` unchanged."""
        return score

    def response_opening(self, problem: Problem, prefix: str) -> str:
        """The text a coach-guided response (``plugins.coach_guide``, docs/plugins.md) is forced to start with
        for coach ``prefix``. Default: the prefix as the response's first line."""
        return f"{prefix}\n"

    def format_prompt(self, problem: Problem) -> str:
        """The user message: the problem prompt followed by the answer-format instruction."""
        if not self.instruction:
            return problem.prompt
        return f"{problem.prompt}\n\n{self.instruction}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, reward_kind={self.reward_kind!r})"


class StaticTask(Task):
    """A task whose splits are materialised lists of problems.

    ``split_problems`` maps split name to problems; an ``all`` split (every problem, in split
    order) is added automatically unless given.
    """

    def __init__(
        self,
        name: str,
        split_problems: dict[str, list[Problem]],
        *,
        reward_kind: str | None = None,
        instruction: str | None = BOXED_INSTRUCTION,
    ) -> None:
        self.name = name
        if reward_kind is not None:
            self.reward_kind = reward_kind
        if self.reward_kind not in REWARD_KINDS:
            known = ", ".join(REWARD_KINDS)
            raise ValueError(f"task {name!r}: unknown reward kind {self.reward_kind!r}; known: {known}")
        self.instruction = instruction
        self._splits = dict(split_problems)
        if "all" not in self._splits:
            self._splits["all"] = [p for part in split_problems.values() for p in part]
        self.splits = tuple(self._splits)
        _check_unique_ids(name, self._splits["all"])

    def problems(self, split: str = "train") -> list[Problem]:
        """Return a copy of the problem list of ``split``; unknown splits raise ``ValueError``."""
        if split not in self._splits:
            raise ValueError(self._missing_split_message(split))
        return list(self._splits[split])

    def _missing_split_message(self, split: str) -> str:
        return f"task {self.name!r} has no split {split!r}; available: {', '.join(self.splits)}"


def _check_unique_ids(name: str, problems: Iterable[Problem]) -> None:
    seen: set[str] = set()
    for problem in problems:
        if problem.id in seen:
            raise ValueError(f"task {name!r}: duplicate problem id {problem.id!r}")
        seen.add(problem.id)


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator registering a built-in task factory under ``name``.

    The factory is called as ``factory(seed=seed, **options)`` and must return a :class:`Task`.
    """

    def decorate(factory: TaskFactory) -> TaskFactory:
        if name in _BUILTINS:
            raise ValueError(f"task {name!r} is already registered")
        _BUILTINS[name] = factory
        return factory

    return decorate


def register_task_prefix(prefix: str, form: str) -> Callable[[PrefixFactory], PrefixFactory]:
    """Decorator registering a factory for specs ``PREFIX:ARG`` (e.g. ``rg:NAME``).

    The factory is called as ``factory(arg, seed=seed, **options)``; ``form`` (e.g. ``"rg:NAME"``)
    is what :func:`list_tasks` and error messages show.
    """

    def decorate(factory: PrefixFactory) -> PrefixFactory:
        if prefix in _PREFIXES:
            raise ValueError(f"task prefix {prefix!r} is already registered")
        _PREFIXES[prefix] = (factory, form)
        return factory

    return decorate


def register_spec_loader(prefix: str) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator registering the loader of specs ``PREFIX:...`` that parses the whole spec itself (``env:``, whose
    ``data=`` option holds a whole task spec). The loader is called as ``loader(spec, seed=seed, **options)``."""

    def decorate(loader: TaskFactory) -> TaskFactory:
        if prefix in _SPEC_LOADERS:
            raise ValueError(f"task spec loader {prefix!r} is already registered")
        _SPEC_LOADERS[prefix] = loader
        return loader

    return decorate


def _prefix_of(spec: str) -> str:
    return spec.split(":", 1)[0] if ":" in spec else ""


def list_tasks() -> list[str]:
    """Registered built-in task names followed by the prefix forms (``rg:NAME``, ``jsonl:PATH``, ...)."""
    return sorted(_BUILTINS) + sorted([*(form for _, form in _PREFIXES.values()), "env:ENV?...&data=SPEC"])


def load_task(spec: str, *, seed: int = 0, **options: Any) -> Task:
    """Create the task described by ``spec`` (see the module docstring for the syntax).

    ``seed`` fixes every random choice (generated problems, held-out split); a ``seed`` in the
    spec's query string overrides it.  Unknown specs raise ``ValueError`` listing the known forms.
    """
    if spec.partition("?")[0].startswith("env:"):  # its data= option holds a whole task spec: parsed there
        _import_provider("env")
        return _SPEC_LOADERS["env"](spec, seed=seed, **options)
    base, query = split_spec(spec)
    opts = {**query, **options}
    seed = int_option(spec, "seed", opts.pop("seed", seed))
    _import_provider(base)
    if base in _BUILTINS:
        return _BUILTINS[base](seed=seed, **opts)
    prefix = _prefix_of(base)
    if prefix in _PREFIXES:
        arg = base[len(prefix) + 1 :]
        factory, form = _PREFIXES[prefix]
        if not arg:
            raise ValueError(f"task spec {spec!r} is missing its argument; expected the form {form}")
        return factory(arg, seed=seed, **opts)
    raise ValueError(f"unknown task spec {spec!r}; known forms: {', '.join(list_tasks())}")


# Task families that live above the tasks (the testbed trains a model for its warm start; ``env:`` tasks run
# multi-turn episodes, meshrl.agents) register themselves when their package is imported; the registry imports
# them by name on first use, so meshrl.tasks never imports them statically.
LAZY_PROVIDERS: dict[str, str] = {"testbed": "meshrl.testbed", "env": "meshrl.agents"}


def _import_provider(base: str) -> None:
    family = base.split(":", 1)[0]
    if base not in _BUILTINS and family in LAZY_PROVIDERS:
        import importlib

        importlib.import_module(LAZY_PROVIDERS[family])


def with_kind(task: Task, kind: str) -> Task:
    """A copy of ``task`` graded with reward ``kind`` (``meshrl eval --kind``), its prompts unchanged.

    Only tasks graded by kind (:meth:`Task.score` not overridden) can change it; every reference answer is
    checked for the new kind first, so ``--kind number`` on LaTeX answers fails naming a problem instead of
    counting every sample as a grading error.
    """
    import copy

    from meshrl.rewards.grading import REWARD_KINDS as GRADED_KINDS
    from meshrl.rewards.grading import check_reference

    if kind not in GRADED_KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; known: {', '.join(GRADED_KINDS)}")
    if type(task).score is not Task.score:
        raise ValueError(f"task {task.name!r} is scored by its own scorer ({type(task).__name__}.score); a reward "
                         f"kind applies only to tasks graded by kind (jsonl:, parquet:, math500, gsm8k, aime:, ...)")
    for split in task.splits:
        for problem in task.problems(split):
            why = check_reference(problem.answer, kind)
            if why:
                raise ValueError(f"task {task.name!r}, problem {problem.id!r}: the reference answer {why}")
    out = copy.copy(task)
    out.reward_kind = kind
    return out


def take_options(task: str, options: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Merge ``options`` into ``defaults``; an option not in ``defaults`` raises ``ValueError``."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"task {task!r}: unknown option(s) {unknown}; known: {sorted(defaults)}")
    return {**defaults, **{key: _typed_option(task, key, value, defaults[key]) for key, value in options.items()}}


def _typed_option(task: str, key: str, value: Any, default: Any) -> Any:
    """``value`` checked against the type of the option's default (a ``None`` default takes anything): an
    integer option needs an integer, a number option a finite number, a flag true/false; a text option takes
    text, or a number as its text (spec values like ``answer=2024`` arrive as numbers), or ``None``."""
    import math

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"task {task!r}: option {key} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        return int_option(task, key, value)
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"task {task!r}: option {key} must be a finite number, got {value!r}")
        return float(value)
    if isinstance(default, str) and value is not None and not isinstance(value, str):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"task {task!r}: option {key} must be text, got {value!r}")
        return str(value)
    return value
