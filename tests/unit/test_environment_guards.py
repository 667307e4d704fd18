"""Environments as hostile input: an environment's reward follows the reward functions' policy (counted, clamped,
the environment named; `meshrl eval` says what it could not score), environments that fail to load fail in one
line naming the module, factory or method, and every `env:` option (and doctor threshold) is typed, bounded and
finite."""

from __future__ import annotations

import math
import sys
import types

import pytest
from agents_support import CounterEnv

from meshrl.agents import ConventionError, environment_reward, load_environment, reset_environment
from meshrl.agents.environment import EnvironmentReward, checked_factory, count_reward_failures
from meshrl.doctor import DEFAULT
from meshrl.rewards import RewardError, RewardRunner
from meshrl.settings import check_settings, parse_settings, setting
from meshrl.tasks import load_task


def _env_returning(value):
    class Returning(CounterEnv):
        def get_reward(self):
            if isinstance(value, BaseException):
                raise value
            return value

    return Returning()


# ---- the reward: the reward functions' policy ----

@pytest.mark.parametrize("value, scored, what", [
    (float("nan"), 0.0, "returned NaN"),
    (float("inf"), 1.0, "outside [0, 1]; clamped to 1"),
    (float("-inf"), 0.0, "outside [0, 1]; clamped to 0"),
    (10**400, 1.0, "outside [0, 1]; clamped to 1"),
    (1e30, 1.0, "outside [0, 1]; clamped to 1"),
    (-5, 0.0, "outside [0, 1]; clamped to 0"),
    ("0.75", 0.0, "returned a non-number str"),
    (None, 0.0, "returned a non-number NoneType"),
    (True, 0.0, "returned a non-number bool"),
    (RuntimeError("no state"), 0.0, "raised RuntimeError: no state"),
    (SystemExit(3), 0.0, "raised SystemExit(3)"),
], ids=["nan", "inf", "-inf", "10**400", "1e30", "-5", "str", "None", "bool", "raises", "exits"])
def test_a_bad_environment_reward_is_scored_counted_and_named(value, scored, what, caplog):
    reward = environment_reward(_env_returning(value), "p7")
    assert isinstance(reward, EnvironmentReward) and float(reward) == scored
    assert reward.failure is not None and what in reward.failure
    assert "problem p7" in reward.failure and "Returning.get_reward" in reward.failure  # the environment named
    assert reward.failure in caplog.text  # logged, as a reward function's failure is


def test_a_good_environment_reward_is_unchanged():
    for value in (0.0, 0.25, 1, 1.0):
        reward = environment_reward(_env_returning(value))
        assert reward == float(value) and type(float(reward)) is float and reward.failure is None
    assert environment_reward(object()) is None  # no get_reward: the data's grader scores


def test_strict_raises_the_environment_failure():
    with pytest.raises(RewardError, match=r"Returning.get_reward\) returned NaN"):
        environment_reward(_env_returning(float("nan")), strict=True)


def test_environment_failures_count_as_reward_errors():
    runner = RewardRunner(lambda c, p: 1.0, isolation="inline")
    rewards = [environment_reward(_env_returning(v)) for v in (0.5, float("nan"), 3.0)] + [None, 0.5]
    assert count_reward_failures(rewards, runner) == 2
    assert runner.pop_stats() == {"reward/errors": 2, "reward/timeouts": 0}
    assert "clamped to 1" in runner.last_failure
    import pickle

    copy = pickle.loads(pickle.dumps(rewards[1]))  # rows cross process boundaries with their failure
    assert copy == 0.0 and copy.failure == rewards[1].failure
    strict = RewardRunner(lambda c, p: 1.0, isolation="inline", strict=True)  # reward.strict: the run stops
    with pytest.raises(RewardError, match=r"returned NaN"):
        count_reward_failures(rewards, strict)
    assert count_reward_failures([environment_reward(_env_returning(0.5))], strict) == 0


def test_eval_says_what_it_could_not_score(tmp_path, monkeypatch):
    from meshrl.evaluation import EvalConfig, run_eval

    class NanEnv(CounterEnv):
        def get_reward(self) -> float:
            return float("nan")

    module = types.ModuleType("q_guard_envs")
    module.NanEnv = NanEnv
    monkeypatch.setitem(sys.modules, "q_guard_envs", module)
    spec = "env:q_guard_envs:NanEnv?max_turns=2&max_total_tokens=24&data=tiny:add"
    s = run_eval(EvalConfig(model="tiny", data=spec, n=2, ks=[1], limit=2, max_new_tokens=12, chunk_size=2),
                 tmp_path / "eval", progress=False)
    assert s["reward_stats"]["reward/errors"] == 4 and s["unscored"]["errors"] == 4
    assert "could not be scored" in s["unscored"]["message"] and "NanEnv.get_reward" in s["unscored"]["message"]


# ---- loading: one line naming the module, factory or method ----

@pytest.mark.parametrize("source, message", [
    ("raise RuntimeError('no GPU here')", "importing module 'q_bad_env' raised RuntimeError: no GPU here"),
    ("def broken(:\n    pass", "module 'q_bad_env' has a syntax error"),
    ("import sys\nsys.exit(3)", r"importing module 'q_bad_env' raised SystemExit\(3\)"),
])
def test_a_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch, source, message):
    (tmp_path / "q_bad_env.py").write_text(source + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "q_bad_env", raising=False)
    with pytest.raises(ConventionError, match=message) as info:
        load_environment("q_bad_env:Env")
    assert "\n" not in str(info.value)


def test_a_relative_module_name_is_refused():
    with pytest.raises(ConventionError, match="'.envs' is a relative module name"):
        load_environment(".envs:Env")


def test_a_factory_that_raises_or_returns_none_is_named(monkeypatch):
    def returns_none():
        return None

    def raises():
        raise KeyError("config")

    with pytest.raises(ConventionError, match=r"returns_none\(\) returned None"):
        checked_factory(returns_none)()
    with pytest.raises(ConventionError, match=r"raises\(\) raised KeyError: 'config'"):
        checked_factory(raises)()
    assert isinstance(checked_factory(CounterEnv)(), CounterEnv)
    module = types.ModuleType("q_factory_envs")
    module.make = returns_none
    monkeypatch.setitem(sys.modules, "q_factory_envs", module)
    with pytest.raises(ValueError, match=r"factory .*returns_none\(\) returned None"):
        load_task("env:q_factory_envs:make?data=tiny:repeat")


def test_a_raising_reset_names_the_class_and_reset():
    class Fragile(CounterEnv):
        def reset(self, **kwargs):
            raise KeyError("target")

    with pytest.raises(ConventionError, match=r"Fragile\.reset for problem 3 raised KeyError: 'target'"):
        reset_environment(Fragile(), id="3")
    with pytest.raises(ConventionError, match="has no reset"):
        reset_environment(object())


# ---- options: typed, bounded, finite, once ----

@pytest.mark.parametrize("options, message", [
    ("max_turns=abc", "option max_turns must be an integer >= 1, got 'abc'"),
    ("max_turns=2.5", "option max_turns must be an integer >= 1, got 2.5"),
    ("tool_timeout_s=soon", "option tool_timeout_s must be a finite number in \\(0, 86400\\], got 'soon'"),
    ("tool_timeout_s=nan", "option tool_timeout_s must be a finite number"),
    ("tool_timeout_s=inf", "option tool_timeout_s must be a finite number"),
    ("python_timeout_s=soon", "option python_timeout_s must be a finite number"),
    ("python_timeout_s=-1", r"option python_timeout_s must be in \(0, 86400\], got -1"),
    ("python_timeout_s=nan", "option python_timeout_s must be a finite number"),
    ("on_parse_failure=retry", "option on_parse_failure must be one of respond, end, got 'retry'"),
    ("tools=1", "option tools must be text"),
    ("max_turns=2&max_turns=3", "option max_turns is given twice"),
])
def test_env_options_are_typed_bounded_and_given_once(options, message):
    with pytest.raises(ValueError, match=message) as info:
        load_task(f"env:calculator?{options}&data=tiny:repeat")
    assert "\n" not in str(info.value)


def test_env_options_keep_their_values():
    from meshrl.agents import EpisodeLimits
    from meshrl.agents.task import LIMIT_OPTIONS, EnvOptions

    defaults = EnvOptions()
    assert {k: getattr(defaults, k) for k in LIMIT_OPTIONS} == {k: getattr(EpisodeLimits(), k) for k in LIMIT_OPTIONS}
    task = load_task("env:calculator?max_turns=3&tool_timeout_s=2&max_tool_output_chars=9.0&data=tiny:repeat")
    assert task.limits == EpisodeLimits(max_turns=3, tool_timeout_s=2.0, max_tool_output_chars=9)
    assert type(task.limits.tool_timeout_s) is float and type(task.limits.max_tool_output_chars) is int


def test_settings_refuse_non_finite_numbers_unless_declared():
    from dataclasses import dataclass

    @dataclass
    class Section:
        rate: float = setting(0.5, help="a rate", ge=0)
        cap: float = setting(1.0, help="a cap that may be infinite", ge=0, allow_inf=True)

    assert check_settings(Section()) == []
    assert [k for k, _, _ in check_settings(Section(rate=math.inf))] == ["rate"]
    assert check_settings(Section(rate=math.inf))[0][2] == "a finite number >= 0"
    assert check_settings(Section(cap=math.inf)) == []
    assert [k for k, _, _ in check_settings(Section(cap=math.nan))] == ["cap"]
    assert parse_settings(Section, {"rate": 1, "cap": math.inf}, "here") == Section(rate=1.0, cap=math.inf)
    with pytest.raises(ValueError, match="here: option rate must be a finite number >= 0, got inf"):
        parse_settings(Section, {"rate": math.inf}, "here")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "nan", -1, "abc", True])
def test_doctor_thresholds_are_finite_numbers(value):
    with pytest.raises(ValueError, match=f"threshold kl_max must be a finite number >= 0, got {value!r}"):
        DEFAULT.with_overrides({"kl_max": value})


def test_doctor_thresholds_keep_good_values():
    assert DEFAULT.with_overrides({"kl_max": "0.5", "grad_window": 4.0}).kl_max == 0.5
    assert type(DEFAULT.with_overrides({"grad_window": "4"}).grad_window) is int
    with pytest.raises(ValueError, match="threshold grad_window must be an integer >= 0, got 2.5"):
        DEFAULT.with_overrides({"grad_window": 2.5})


def test_health_thresholds_refuse_nan_in_the_config():
    from meshrl.testing import TINY_RUN
    from meshrl.trainer import load_config

    with pytest.raises(ValueError, match="health.thresholds: threshold kl_max must be a finite number"):
        load_config(overrides=[*TINY_RUN, "health.thresholds.kl_max=.nan"])
