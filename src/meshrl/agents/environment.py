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
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable, Sequence
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


def reset_environment(env: Any, **kwargs: Any) -> str | None:
    """``env.reset(**kwargs)``; its result must be ``None`` or a string (text for the user message)."""
    observation = env.reset(**kwargs)
    if observation is not None and not isinstance(observation, str):
        raise ConventionError(f"{type(env).__qualname__}.reset returned {type(observation).__name__}; it must "
                                "return None or a string (text appended to the user message)")
    return observation


def environment_reward(env: Any) -> float | None:
    """``env.get_reward()`` as a float when the environment defines it (sync or ``async``), else ``None``."""
    get_reward = getattr(type(env), "get_reward", None)
    if get_reward is None:
        return None
    value = asyncio.run(env.get_reward()) if inspect.iscoroutinefunction(get_reward) else env.get_reward()
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ConventionError(f"{type(env).__qualname__}.get_reward returned {value!r}; it must return a "
                                "number") from exc


def load_environment(spec: str) -> EnvironmentFactory:
    """The environment factory named by ``"MODULE:FACTORY"`` (a class or a function returning an instance), e.g.
    ``"my_envs.wordle:WordleEnv"``; ``FACTORY`` may be dotted (``"pkg.mod:Outer.make"``)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConventionError(f"environment spec {spec!r} must be 'MODULE:FACTORY' (e.g. 'my_envs:CounterEnv')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConventionError(f"environment spec {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    factory: Any = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ConventionError(f"environment spec {spec!r}: module {module_name!r} has no attribute "
                                    f"{attribute!r} (missing {part!r})")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ConventionError(f"environment spec {spec!r}: {attribute!r} is a {type(factory).__name__}, not a "
                                "class or function")
    return factory
