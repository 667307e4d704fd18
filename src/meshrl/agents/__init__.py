"""Multi-turn, tool-using episodes (engine layer): environments and tools in TRL's convention, a strict parser of
Qwen/Hermes ``<tool_call>`` blocks, tool execution with time limits, token-exact episodes over any rollout
backend, and their metrics. The trainer's step samples a tool-using task's rollouts through :func:`run_episodes`
(``env:`` tasks, :mod:`meshrl.agents.task`, registered with :func:`meshrl.tasks.load_task` on import;
:mod:`meshrl.trainer.episodes`), and ``meshrl eval`` runs them the same way (docs/agents.md)."""

from meshrl.agents.environment import (
    ConventionError,
    Tool,
    Toolbox,
    environment_methods,
    environment_reward,
    load_environment,
    reset_environment,
    tool_schema,
)
from meshrl.agents.episode import (
    END_REASONS,
    LIMIT_REASONS,
    Episode,
    EpisodeLimits,
    ToolCallRecord,
    run_episodes,
    start_environments,
    turn_seed,
)
from meshrl.agents.execute import CalculatorError, ToolResult, calculator, execute_call, python_tool
from meshrl.agents.metrics import episode_metrics
from meshrl.agents.task import EnvOptions, EnvTask, load_env_task, split_env_spec
from meshrl.agents.tool_calls import (
    PARSE_FAILURE_REASONS,
    ParsedTurn,
    ParseFailure,
    ToolCall,
    ToolResponseRenderer,
    encode_agent_prompt,
    parse_tool_calls,
)

__all__ = [
    "END_REASONS", "LIMIT_REASONS", "PARSE_FAILURE_REASONS", "CalculatorError", "ConventionError", "EnvOptions",
    "EnvTask", "Episode", "EpisodeLimits", "ParseFailure", "ParsedTurn", "Tool", "ToolCall", "ToolCallRecord",
    "ToolResponseRenderer", "ToolResult", "Toolbox", "calculator", "encode_agent_prompt", "environment_methods",
    "environment_reward", "episode_metrics", "execute_call", "load_env_task", "load_environment", "parse_tool_calls",
    "python_tool", "reset_environment", "run_episodes", "split_env_spec", "start_environments", "tool_schema",
    "turn_seed",
]
