"""meshrl.agents.episode with real waits and processes: tool calls of different episodes run concurrently (a barrier
that only concurrent calls pass in time), and the sandboxed Python tool inside an episode."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from agents_support import CounterEnv, ScriptedBackend, call_text, qwen_style_tokenizer  # noqa: E402

from meshrl.agents import EpisodeLimits, Toolbox, encode_agent_prompt, run_episodes  # noqa: E402
from meshrl.rollout.base import SamplingParams  # noqa: E402

TOK = qwen_style_tokenizer()
SCHEMAS = Toolbox(CounterEnv()).schemas
PROMPTS = [encode_agent_prompt(TOK, "Count to 3.", SCHEMAS), encode_agent_prompt(TOK, "Count to 4.", SCHEMAS)]


def _responses(context: list[int]) -> int:
    """Tool-response turns so far (one user turn holds all responses of a model turn)."""
    return TOK.decode(context).count("<|im_start|>user\n<tool_response>")


def test_tool_calls_of_different_episodes_run_concurrently():
    """Four episodes' calls meet at a barrier for four: only concurrent calls pass it in time."""
    def run(workers: int):
        barrier = threading.Barrier(4, timeout=2)

        def meet(tag: int) -> str:
            """Wait for the other episodes.

            Args:
                tag: A label.
            """
            barrier.wait()
            return f"met {tag}"

        def script(context, row, seed):
            return call_text("meet", {"tag": row}) if _responses(context) == 0 else "done"

        backend = ScriptedBackend(TOK, script)
        return run_episodes(backend, PROMPTS, None, TOK, SamplingParams(max_new_tokens=200, n=2),
                            EpisodeLimits(tool_timeout_s=1.0), 0, tools=[meet], tool_workers=workers)

    together = run(4)
    assert [e.tool_calls[0].content for e in together] == ["met 0", "met 1", "met 2", "met 3"]
    alone = run(1)
    assert all(e.tool_errors == 1 for e in alone)
    with pytest.raises(ValueError, match="tool_workers must be >= 1"):
        run(0)


def test_the_sandboxed_python_tool_inside_an_episode():
    from meshrl.agents import python_tool

    def script(context, row, seed):
        if _responses(context) == 0:
            return call_text("python", {"code": "print(sum(range(10)))"})
        return "45"

    backend = ScriptedBackend(TOK, script)
    episodes = run_episodes(backend, PROMPTS[:1], None, TOK, SamplingParams(max_new_tokens=200), EpisodeLimits(), 0,
                            tools=[python_tool(timeout_s=5)])
    assert episodes[0].tool_calls[0].content == "45\n" and episodes[0].end_reason == "answer"
    assert "<tool_response>\n45\n\n</tool_response>" in TOK.decode(episodes[0].ids)
