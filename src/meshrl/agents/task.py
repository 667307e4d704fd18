"""Tool-using tasks: ``env:ENV?OPTIONS&data=SPEC`` (multi-turn episodes, :mod:`meshrl.agents`).

Registered with :func:`meshrl.tasks.load_task` when :mod:`meshrl.agents` is imported (the task registry imports it
by name on an ``env:`` spec: ``meshrl.tasks`` sits below the agents and never imports them).

``ENV`` is an environment in TRL's convention (``MODULE:FACTORY``, a class or function whose instance's public
methods are its tools, with ``reset(**row)`` and optionally ``get_reward()``) or a built-in tool set:
``calculator`` (exact arithmetic) or ``python`` (a program run in meshrl's sandbox). ``data=SPEC`` is any task
spec that gives the prompts and answers (``jsonl:problems.jsonl?...``, ``gsm8k:...``, ``tiny:repeat``); it comes
**last** and takes the rest of the spec, so its own ``?`` and ``&`` need no escaping. The episode's reward is
``get_reward()`` when the environment has one, else the data task's grade of the final answer (the last model
turn). Options before ``data=``: ``max_turns`` (4), ``max_tool_calls`` (8), ``max_total_tokens`` (1024: every
token after the prompt, tool output included), ``tool_timeout_s`` (10), ``max_tool_output_chars`` (4000),
``on_parse_failure`` (``respond`` | ``end``), ``tools`` (built-in tool sets offered beside the environment's,
``calculator`` and/or ``python``, comma-separated), ``python_timeout_s`` (5). Each is declared in
:class:`EnvOptions` with its type and bounds (finite, time limits at most a day) and given at most once; anything
else is one line naming the option.

    env:calculator?max_turns=3&data=jsonl:gsm8k.jsonl?problem=question&answer=answer
    env:my_envs.wordle:WordleEnv?data=jsonl:words.jsonl?problem=prompt&answer=word

``reset`` receives the problem's row: ``prompt``, ``answer``, ``id`` and every field of its ``meta``; text it
returns is appended to the user message, as TRL does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from meshrl.settings import parse_settings, setting
from meshrl.tasks import Problem, Task, load_task, register_spec_loader, split_spec

BUILTIN_TOOLSETS = ("calculator", "python")
LIMIT_OPTIONS = ("max_turns", "max_tool_calls", "max_total_tokens", "tool_timeout_s", "max_tool_output_chars",
                 "on_parse_failure")
#: the longest time limit a tool call may be given: a day (a longer wait is no limit, and far longer ones
#: overflow ``threading``'s timeout)
MAX_TIMEOUT_S = 86_400.0


@dataclass(frozen=True)
class EnvOptions:
    """The options of an ``env:`` spec, declared as the config's settings are (type, default, bounds and help
    once, :mod:`meshrl.settings`): the first six are :class:`meshrl.agents.EpisodeLimits`' with its defaults."""

    max_turns: int = setting(4, help="model turns per episode", ge=1)
    max_tool_calls: int = setting(8, help="executed tool calls per episode", ge=1)
    max_total_tokens: int = setting(1024, help="tokens after the prompt, tool output included", ge=1)
    tool_timeout_s: float = setting(10.0, help="time limit of one tool call, seconds", gt=0, le=MAX_TIMEOUT_S)
    max_tool_output_chars: int = setting(4000, help="characters of a tool result the model reads", ge=1)
    on_parse_failure: str = setting("respond", help="what a refused tool-call turn does",
                                    choices=("respond", "end"))
    tools: str = setting("", help="built-in tool sets offered beside the environment's, comma-separated")
    python_timeout_s: float = setting(5.0, help="time limit of the python tool's program, seconds", gt=0,
                                      le=MAX_TIMEOUT_S)


def split_env_spec(spec: str) -> tuple[str, dict[str, Any], str]:
    """``"env:ENV?k=v&data=SPEC"`` -> ``(ENV, {k: v}, SPEC)``: ``data=`` takes the rest of the spec."""
    base, _, query = spec.partition("?")
    env = base.removeprefix("env:")
    if not env:
        raise ValueError(f"task spec {spec!r}: name an environment (env:MODULE:FACTORY, env:calculator, env:python)")
    head, sep, data = query.partition("data=") if query.startswith("data=") else query.partition("&data=")
    if not sep or not data:
        raise ValueError(f"task spec {spec!r}: an environment needs its problems as a last option data=SPEC "
                         "(e.g. data=jsonl:problems.jsonl?problem=question&answer=answer)")
    _, options = split_spec(f"env:{env}?{head}")  # the options before data=, parsed as any task spec's
    return env, options, data


class EnvTask(Task):
    """A data task's problems answered in tool-using episodes (the module docstring). ``episodic`` tells the
    trainer and the evaluation to run :func:`meshrl.agents.run_episodes` instead of one completion per prompt."""

    episodic = True

    def __init__(self, name: str, data: Task, factory: Callable[[], Any] | None, tools: list[Callable[..., Any]],
                 limits: Any) -> None:
        from meshrl.agents.environment import Toolbox, checked_factory

        # checked: a factory that raises or returns None is one line naming it, here and in every episode
        factory = checked_factory(factory) if factory is not None else None
        self.name, self.data, self.factory, self.tools, self.limits = name, data, factory, tools, limits
        self.reward_kind, self.instruction, self.splits = data.reward_kind, data.instruction, data.splits
        probe = factory() if factory is not None else None  # one instance, not reset: its tools and reward
        #: whether the environment scores the episode (``get_reward``) instead of the data's grader
        self.owns_reward = callable(getattr(probe, "get_reward", None))
        #: the tools' JSON schemas, as the prompt shows them
        self.schemas: list[dict] = Toolbox(probe, tools).schemas
        names = [s["function"]["name"] for s in self.schemas]
        #: strategy labels: the tool pattern of an episode (label_strategy)
        self.strategies: tuple[str, ...] = ("direct", *names, *(("mixed",) if len(names) > 1 else ()))

    def problems(self, split: str = "train") -> list[Problem]:
        return self.data.problems(split)

    def format_prompt(self, problem: Problem) -> str:
        return self.data.format_prompt(problem)

    def score(self, completion: str, problem: Problem) -> float:
        return self.data.score(completion, problem)

    def label_strategy(self, completion: str) -> str | None:
        """The tool pattern of an episode's model turns (``meshrl.trainer.episodes.transcript``): ``direct`` when
        no turn called a tool, the tool's name when one tool was called, ``mixed`` for several; None when a
        ``<tool_call>`` block does not pass the episodes' own strict parser (not guessed)."""
        from meshrl.agents import parse_tool_calls

        parsed = parse_tool_calls(completion, {s["function"]["name"]: s["function"]["parameters"]
                                               for s in self.schemas})
        if parsed.failure is not None:
            return None
        called = {call.name for call in parsed.calls}
        if not called:
            return "direct"
        return called.pop() if len(called) == 1 else "mixed"

    def coach_strategies(self, problem: Problem) -> list[str] | None:
        """The data task's own rule strategies, else tool plans for Mesh's coach prefixes: one per tool ("call it
        first"), then answering without a tool."""
        own = self.data.coach_strategies(problem)
        if own:
            return own
        plans = [f"Plan: call the {s['function']['name']} tool first, read its result, then give the final answer."
                 for s in self.schemas]
        return [*plans, "Plan: answer directly, without calling any tool."]

    def encode_prompt(self, tokenizer: Any, text: str, *, system: str | None = None,
                      assistant_prefix: str | None = None) -> list[int]:
        """Prompt ids that show the tools (:func:`meshrl.agents.encode_agent_prompt`), with the same ``system`` and
        ``assistant_prefix`` conditioning as :func:`meshrl.models.encode_prompt` (a coach prefix)."""
        from meshrl.agents import encode_agent_prompt

        ids = encode_agent_prompt(tokenizer, text, self.schemas, system=system)
        if assistant_prefix:
            ids = ids + list(tokenizer.encode(assistant_prefix, add_special_tokens=False))
        return ids

    def reset_kwargs(self, problem: Problem) -> dict[str, Any]:
        """What ``reset`` receives: the problem's row (TRL passes the dataset row's columns)."""
        return {**problem.meta, "prompt": problem.prompt, "answer": problem.answer, "id": problem.id}


def _toolset(name: str, options: EnvOptions, spec: str) -> Callable[..., Any]:
    from meshrl.agents import calculator, python_tool

    if name == "calculator":
        return calculator
    if name == "python":
        return python_tool(timeout_s=options.python_timeout_s)
    raise ValueError(f"task spec {spec!r}: unknown tool set {name!r}; built-in: {', '.join(BUILTIN_TOOLSETS)}")


def env_options(spec: str, options: dict[str, Any]) -> EnvOptions:
    """``options`` of ``spec`` typed and bounded (:class:`EnvOptions`); anything else is one ``ValueError`` naming
    the spec and the option."""
    known = [f.name for f in fields(EnvOptions)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"task spec {spec!r}: unknown option(s) {unknown}; known: {', '.join([*known, 'data'])}")
    return parse_settings(EnvOptions, options, f"task spec {spec!r}")


@register_spec_loader("env")
def load_env_task(spec: str, *, seed: int = 0, **extra: Any) -> EnvTask:
    """The :class:`EnvTask` of ``spec`` (the module docstring); unknown options are refused by name."""
    from meshrl.agents import EpisodeLimits, load_environment

    env, options, data_spec = split_env_spec(spec)
    opts = env_options(spec, {**options, **extra})
    limits = EpisodeLimits(**{k: getattr(opts, k) for k in LIMIT_OPTIONS})
    names = [env] if env in BUILTIN_TOOLSETS else []
    names += [t for t in opts.tools.split(",") if t]
    factory = None if env in BUILTIN_TOOLSETS else load_environment(env)
    tools = [_toolset(name, opts, spec) for name in dict.fromkeys(names)]
    data = load_task(data_spec, seed=seed)
    if getattr(data, "episodic", False):
        raise ValueError(f"task spec {spec!r}: data={data_spec!r} is itself an environment")
    return EnvTask(f"env:{env}", data, factory, tools, limits)
