"""meshrl.agents.environment: TRL's environment convention (tool discovery, schemas, reset, get_reward) and
load_environment's errors."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
from agents_support import CounterEnv

from meshrl.agents import ConventionError, Toolbox, environment_reward, load_environment, reset_environment


def test_tools_are_the_public_methods_as_trl_lists_them():
    env = CounterEnv()
    box = Toolbox(env)
    # TRL 1.16, GRPOTrainer.__init__: getmembers on the class, minus reset / get_reward / private names
    trl_rule = [name for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
                if name not in ("reset", "get_reward") and not name.startswith("_")]
    assert box.names == trl_rule == ["increment", "read"]
    schema = box.tools["increment"].schema
    assert schema["function"]["name"] == "increment"
    assert schema["function"]["parameters"] == {"type": "object", "required": ["step"],
                                                "properties": {"step": {"type": "integer", "description":
                                                                        "How much to add."}}}
    assert box.call("increment", {"step": 2}) == 2 and env.count == 2  # bound to this instance
    with pytest.raises(KeyError, match="unknown tool 'reset'"):
        box.call("reset", {})


def test_standalone_tools_come_first_and_names_must_be_unique():
    def read(path: str) -> str:
        """Read a file.

        Args:
            path: The file.
        """
        return path

    def square(x: int) -> int:
        """Square a number.

        Args:
            x: The number.
        """
        return x * x

    assert Toolbox(CounterEnv(), [square]).names == ["square", "increment", "read"]
    with pytest.raises(ConventionError, match="two tools are named 'read'"):
        Toolbox(CounterEnv(), [read])


def test_a_tool_without_a_schema_is_refused_by_name():
    def vague(x) -> str:
        """No hints."""
        return str(x)

    with pytest.raises(ConventionError, match="tool 'test_a_tool_without_a_schema_is_refused_by_name.<locals>.vague'"):
        Toolbox(None, [vague])


def test_reset_and_reward():
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: A number.
            """
            return x

    with pytest.raises(ConventionError, match="NoReset defines no reset"):
        Toolbox(NoReset())

    class Observed(CounterEnv):
        def reset(self, **kwargs):
            return kwargs["text"]

    assert reset_environment(Observed(), text="go") == "go"
    with pytest.raises(ConventionError, match="returned int"):
        reset_environment(Observed(), text=3)

    env = CounterEnv()
    reset_environment(env, target=2)
    env.increment(2)
    assert environment_reward(env) == 1.0

    class AsyncReward(CounterEnv):
        async def get_reward(self) -> float:
            return 0.25

    assert environment_reward(AsyncReward()) == 0.25
    assert environment_reward(NoReset()) is None


def test_async_tools_run():
    async def later(x: int) -> int:
        """Wait, then answer.

        Args:
            x: A number.
        """
        return x + 1

    assert Toolbox(None, [later]).call("later", {"x": 1}) == 2


def test_load_environment(monkeypatch):
    module = types.ModuleType("agents_envs_for_test")
    module.CounterEnv = CounterEnv
    module.NOT_CALLABLE = 3
    module.Outer = type("Outer", (), {"make": staticmethod(CounterEnv)})
    monkeypatch.setitem(sys.modules, "agents_envs_for_test", module)
    assert load_environment("agents_envs_for_test:CounterEnv") is CounterEnv
    assert isinstance(load_environment("agents_envs_for_test:Outer.make")(), CounterEnv)
    with pytest.raises(ConventionError, match="must be 'MODULE:FACTORY'"):
        load_environment("agents_envs_for_test.CounterEnv")
    with pytest.raises(ConventionError, match="cannot import module 'no_such_module_xyz'"):
        load_environment("no_such_module_xyz:Env")
    with pytest.raises(ConventionError, match="has no attribute 'Missing'"):
        load_environment("agents_envs_for_test:Missing")
    with pytest.raises(ConventionError, match="'NOT_CALLABLE' is a int"):
        load_environment("agents_envs_for_test:NOT_CALLABLE")
