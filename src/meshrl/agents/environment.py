"""Tool environments in TRL's convention (``GRPOTrainer(environment_factory=..., tools=...)``, TRL 1.16).

* A **tool** is a plain Python function (sync or ``async``) with type hints and a Google-style docstring whose
  ``Args:`` section describes every argument; its JSON schema is the one the chat template shows the model,
  ``transformers.utils.get_json_schema`` (``{"type": "function", "function": {"name", "description",
  "parameters": {"type": "object", "properties", "required"}}}``).
* An **environment** is a class whose public methods are its tools, plus ``reset(**kwargs)`` (required; returns
  ``None`` or text that is appended to the last user message) and an optional ``get_reward()`` (no argument,
  returns a float: the environment owns the reward). One instance per rollout, so episodes share no state.
  Tools are listed on the *class* (``inspect.getmembers(type(env), inspect.isfunction)``, TRL's rule: listing the
  instance would evaluate properties), skipping ``reset``, ``get_reward`` and names starting with ``_``.

:class:`Toolbox` holds the tools one episode may call (its environment's bound methods plus standalone tool
functions), their schemas, and :meth:`Toolbox.call`; :func:`load_environment` imports a factory from a
``"MODULE:FACTORY"`` string.

What an environment does wrong fails in one line naming it (:class:`ConventionError`, a ``ValueError``): a module
that raises or exits while imported, a factory that raises or returns ``None``, a ``reset`` that raises. Its
reward follows the reward functions' policy (:class:`meshrl.rewards.RewardRunner`): a raising ``get_reward``, a
non-number or NaN scores 0, a value outside [0, 1] is clamped, and each is logged naming the environment and
carried on the reward (:class:`EnvironmentReward`) to be counted as a reward error; it never ends a run, since
the episode it scores was written by the model.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

RESERVED_METHODS = ("reset", "get_reward")

EnvironmentFactory = Callable[[], Any]


class ConventionError(ValueError):
    """An environment or tool breaks the convention (no ``reset``, a tool without a usable schema, a bad factory
    spec); the message names the class, tool or module."""


@dataclass(frozen=True)
class Tool:
    """A callable tool: ``name`` (the function's ``__name__``, what the model writes), ``function`` (bound when it
    is an environment method) and ``schema`` (``get_json_schema``'s dict)."""

    name: str
    function: Callable[..., Any]
    schema: dict

    @property
    def parameters(self) -> dict:
        """The JSON schema of the arguments object (``{"type": "object", "properties": ..., "required": ...}``)."""
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})

    def invoke(self, arguments: dict[str, Any]) -> Any:
        """Call the tool with keyword ``arguments``; an ``async`` tool runs to completion on a fresh event loop."""
        if inspect.iscoroutinefunction(self.function):
            return asyncio.run(self.function(**arguments))
        return self.function(**arguments)


def tool_schema(function: Callable[..., Any]) -> dict:
    """``transformers.utils.get_json_schema(function)``, with an error naming the tool when its hints or docstring
    cannot make a schema (a missing type hint, an argument the docstring does not describe)."""
    from transformers.utils import get_json_schema

    name = getattr(function, "__qualname__", repr(function))
    try:
        return get_json_schema(function)
    except Exception as exc:  # transformers raises its own TypeError / DocstringParsingException subclasses
        raise ConventionError(
            f"tool {name!r} has no usable JSON schema ({type(exc).__name__}: {exc}); a tool needs a type hint on "
            "every argument and a Google-style docstring with an 'Args:' line for each") from exc


def environment_methods(env: Any) -> list[Callable[..., Any]]:
    """The tool methods of ``env`` (bound), TRL's rule: public functions of its class except ``reset`` and
    ``get_reward``, in name order. Raises when the class has no callable ``reset``."""
    members = inspect.getmembers(type(env), predicate=inspect.isfunction)
    names = [name for name, _ in members]
    if "reset" not in names:
        raise ConventionError(f"environment {type(env).__qualname__} defines no reset(**kwargs) method; every "
                                "environment needs one (it may return None)")
    return [getattr(env, name) for name in names if name not in RESERVED_METHODS and not name.startswith("_")]


class Toolbox:
    """The tools one episode may call, by name: standalone ``tools`` first, then ``env``'s methods (TRL's order).

    Two tools with the same name are refused (the model could not tell them apart)."""

    def __init__(self, env: Any | None = None, tools: Sequence[Callable[..., Any]] = ()):
        self.env = env
        functions = [*tools, *(environment_methods(env) if env is not None else [])]
        self.tools: dict[str, Tool] = {}
        for function in functions:
            name = function.__name__
            if name in self.tools:
                raise ConventionError(f"two tools are named {name!r} (environment "
                                        f"{type(env).__qualname__ if env is not None else 'none'}); rename one")
            self.tools[name] = Tool(name, function, tool_schema(function))

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    @property
    def schemas(self) -> list[dict]:
        """The tools' JSON schemas, for ``apply_chat_template(tools=...)`` and the call parser."""
        return [tool.schema for tool in self.tools.values()]

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """Run tool ``name`` with ``arguments`` (already checked against its schema by the parser); unknown names
        raise ``KeyError`` naming the known tools."""
        if name not in self.tools:
            raise KeyError(f"unknown tool {name!r}; known: {self.names}")
        return self.tools[name].invoke(arguments)


def qualified_name(obj: Any) -> str:
    """``module.QualName`` of a class or function (of ``type(obj)`` for an instance): how errors name it."""
    target = obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj)
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}" if module and module != "builtins" else name


def checked_factory(factory: EnvironmentFactory) -> EnvironmentFactory:
    """``factory`` made to fail in one line naming it: a raised exception (``SystemExit`` included: a factory must
    not end the run without a word) or a ``None`` instance is a :class:`ConventionError`."""
    name = qualified_name(factory)

    def make() -> Any:
        try:
            env = factory()
        except (Exception, SystemExit) as exc:
            raise ConventionError(f"environment factory {name}() raised {_what(exc)}") from exc
        if env is None:
            raise ConventionError(f"environment factory {name}() returned None; it must return an environment "
                                  "instance (an object with a reset(**kwargs) method)")
        return env

    make.__wrapped__ = factory  # type: ignore[attr-defined]  (inspect.unwrap finds the user's factory)
    return make


def _what(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) (sys.exit)"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__  # one line


def reset_environment(env: Any, **kwargs: Any) -> str | None:
    """``env.reset(**kwargs)``; its result must be ``None`` or a string (text for the user message). A missing or
    raising ``reset`` is a :class:`ConventionError` naming the class and the problem."""
    reset = getattr(env, "reset", None)
    if not callable(reset):
        raise ConventionError(f"environment {qualified_name(env)} has no reset(**kwargs) method; every environment "
                              "needs one (it may return None)")
    try:
        observation = reset(**kwargs)
    except (Exception, SystemExit) as exc:
        problem = f" for problem {kwargs['id']}" if "id" in kwargs else ""
        raise ConventionError(f"{qualified_name(env)}.reset{problem} raised {_what(exc)}") from exc
    if observation is not None and not isinstance(observation, str):
        raise ConventionError(f"{type(env).__qualname__}.reset returned {type(observation).__name__}; it must "
                                "return None or a string (text appended to the user message)")
    return observation


class EnvironmentReward(float):
    """An environment's reward as it scores the episode (in [0, 1]), with ``failure``: the logged message when
    ``get_reward`` failed (raised, returned a non-number or NaN: scored 0; outside [0, 1]: clamped), else
    ``None``. A float, so every consumer of rewards reads it unchanged; :func:`count_reward_failures` counts it."""

    failure: str | None

    def __new__(cls, value: float, failure: str | None = None) -> EnvironmentReward:
        reward = super().__new__(cls, value)
        reward.failure = failure
        return reward

    def __reduce__(self) -> tuple[Any, ...]:
        return (EnvironmentReward, (float(self), self.failure))


@dataclass(frozen=True)
class _RewardCall:
    """What the reward runner scores: the environment, and ``id``, how its messages name the reward."""

    env: Any
    id: str


def _get_reward(_completion: str, call: _RewardCall) -> Any:
    env = call.env
    value = asyncio.run(env.get_reward()) if inspect.iscoroutinefunction(type(env).get_reward) else env.get_reward()
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:  # an integer beyond float's range (10**400): infinitely far outside [0, 1]
            return math.inf if value > 0 else -math.inf
    return value


def environment_reward(env: Any, problem_id: str | None = None, *, strict: bool = False
                       ) -> EnvironmentReward | None:
    """``env.get_reward()`` (sync or ``async``) under the reward functions' policy (module docstring) when the
    environment defines it, else ``None``. ``strict``: raise :class:`meshrl.rewards.RewardError` instead."""
    from meshrl.rewards import RewardRunner

    if getattr(type(env), "get_reward", None) is None:
        return None
    name = f"{problem_id if problem_id is not None else '?'} (environment {qualified_name(env)}.get_reward)"
    runner = RewardRunner(_get_reward, timeout_s=None, strict=strict, isolation="inline")
    value = runner.score_one("", _RewardCall(env, name))
    failed = any(runner.pop_stats().values())
    return EnvironmentReward(value, runner.last_failure if failed else None)


def count_reward_failures(rewards: Iterable[Any], runner: Any) -> int:
    """Add the failed environment rewards among ``rewards`` (:class:`EnvironmentReward` with a ``failure``) to
    ``runner``'s ``reward/errors`` (a :class:`meshrl.rewards.RewardRunner`'s counters, so that they are reported
    and checked as a reward function's errors) and its ``last_failure``; return how many there were. A ``strict``
    runner (``reward.strict``) raises :class:`meshrl.rewards.RewardError` with the first failure instead, as it does
    for its own reward function."""
    failures = [r.failure for r in rewards if isinstance(r, EnvironmentReward) and r.failure is not None]
    if failures:
        runner.stats["reward/errors"] = runner.stats.get("reward/errors", 0) + len(failures)
        runner.last_failure = failures[-1]
        if getattr(runner, "strict", False):
            from meshrl.rewards import RewardError

            raise RewardError(failures[0])
    return len(failures)


def load_environment(spec: str) -> EnvironmentFactory:
    """The environment factory named by ``"MODULE:FACTORY"`` (a class or a function returning an instance), e.g.
    ``"my_envs.wordle:WordleEnv"``; ``FACTORY`` may be dotted (``"pkg.mod:Outer.make"``). Whatever goes wrong is
    one :class:`ConventionError` naming the spec and the module or attribute."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConventionError(f"environment spec {spec!r} must be 'MODULE:FACTORY' (e.g. 'my_envs:CounterEnv')")
    if module_name.startswith("."):
        raise ConventionError(f"environment spec {spec!r}: {module_name!r} is a relative module name; give the "
                              "module's full import path (e.g. 'my_envs.wordle:WordleEnv')")
    module = _import(spec, module_name)
    factory: Any = module
    for part in attribute.split("."):
        try:
            found = hasattr(factory, part)
        except Exception as exc:  # a module __getattr__ that raises something else than AttributeError
            raise ConventionError(f"environment spec {spec!r}: looking up {part!r} raised {_what(exc)}") from exc
        if not found:
            raise ConventionError(f"environment spec {spec!r}: module {module_name!r} has no attribute "
                                    f"{attribute!r} (missing {part!r})")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ConventionError(f"environment spec {spec!r}: {attribute!r} is a {type(factory).__name__}, not a "
                                "class or function")
    return factory


def _import(spec: str, module_name: str) -> Any:
    """``importlib.import_module(module_name)``; anything the import raises (a missing module, a syntax error, an
    exception in its code, ``sys.exit``) is one line naming the module. Ctrl-C still interrupts."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ConventionError(f"environment spec {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    except SyntaxError as exc:
        where = f"{exc.filename}, line {exc.lineno}" if exc.filename else f"line {exc.lineno}"
        raise ConventionError(f"environment spec {spec!r}: module {module_name!r} has a syntax error ({where}: "
                              f"{exc.msg})") from exc
    except (Exception, SystemExit) as exc:
        raise ConventionError(f"environment spec {spec!r}: importing module {module_name!r} raised "
                              f"{_what(exc)}") from exc
