"""meshrl.agents.episode: token-exact episodes over a scripted backend (no drift, the mask, the log-probs), the
limits, parse failures, tool errors inside an episode, determinism, TRL-convention environments, the metrics."""

from __future__ import annotations

import json
import random
import threading

import pytest
from agents_support import CounterEnv, ScriptedBackend, call_text, qwen_style_tokenizer

from meshrl.agents import (
    EpisodeLimits,
    Toolbox,
    ToolResponseRenderer,
    encode_agent_prompt,
    episode_metrics,
    run_episodes,
    start_environments,
    turn_seed,
)
from meshrl.rollout.base import SamplingParams

TOK = qwen_style_tokenizer()
SCHEMAS = Toolbox(CounterEnv()).schemas
PROMPTS = [encode_agent_prompt(TOK, "Count to 3.", SCHEMAS), encode_agent_prompt(TOK, "Count to 4.", SCHEMAS)]


def _responses(context: list[int]) -> int:
    """Tool-response turns so far (one user turn holds all responses of a model turn)."""
    return TOK.decode(context).count("<|im_start|>user\n<tool_response>")


def counting_script(context: list[int], row: int, seed: int) -> str:
    """Two turns of increments (step = 1 + row % 2), then an answer."""
    if _responses(context) < 2:
        return "I will add.\n" + call_text("increment", {"step": 1 + row % 2})
    return "The count is done."


def _run(script, limits: EpisodeLimits | None = None, n=2, seed=7, max_new_tokens=200, **kwargs):
    limits = limits or EpisodeLimits()
    backend = ScriptedBackend(TOK, script)
    params = SamplingParams(max_new_tokens=max_new_tokens, n=n)
    episodes = run_episodes(backend, PROMPTS, CounterEnv, TOK, params, limits, seed, **kwargs)
    return backend, episodes


def test_ids_are_exactly_the_sampled_turns_and_the_tool_tokens():
    backend, episodes = _run(counting_script, reset_kwargs=[{"target": 2}, {"target": 4}])
    renderer = ToolResponseRenderer(TOK)
    assert [e.prompt_index for e in episodes] == [0, 0, 1, 1] and len(backend.calls) == 3
    for k, episode in enumerate(episodes):
        assert episode.end_reason == "answer" and episode.turns == 3 and not episode.truncated
        expected_ids, expected_mask, expected_lp = [], [], []
        for turn, (contexts, params, seed, out) in enumerate(backend.calls):
            row = k  # turn 1: sample k of the call; later: every episode is still live, in order
            assert contexts[k if turn else k // 2] == episode.prompt_ids + expected_ids  # the exact context
            assert seed == turn_seed(7, turn) and params.n == (2 if turn == 0 else 1)
            sampled = out.response_ids[row]
            assert episode.ids[slice(*episode.turn_spans[turn])] == sampled
            expected_ids += sampled
            expected_mask += [1] * len(sampled)
            expected_lp += out.engine_logprobs[row]
            if turn < 2:
                tool = renderer.ids([("increment", episode.tool_calls[turn].content)])
                expected_ids += tool
                expected_mask += [0] * len(tool)
                expected_lp += [0.0] * len(tool)
        assert episode.ids == expected_ids and episode.model_mask == expected_mask
        assert episode.engine_logprobs == expected_lp
        assert [r.content for r in episode.tool_calls] == ([str(1 + k % 2), str(2 + 2 * (k % 2))])
        assert episode.final_text == "The count is done."


def test_the_episode_is_the_chat_templates_rendering_of_the_conversation():
    """prompt + ids == the template applied to the whole conversation (up to its final newline)."""
    _, episodes = _run(counting_script, n=1)
    episode = episodes[0]
    messages = [{"role": "user", "content": "Count to 3."}]
    for record in episode.tool_calls:
        call = {"name": record.name, "arguments": record.arguments}
        messages += [{"role": "assistant", "content": "I will add.", "tool_calls": [{"type": "function",
                                                                                     "function": call}]},
                     {"role": "tool", "name": record.name, "content": record.content}]
    messages.append({"role": "assistant", "content": "The count is done."})
    whole = TOK.apply_chat_template(messages, tools=SCHEMAS, tokenize=False)
    assert TOK.decode(episode.prompt_ids + episode.ids) + "\n" == whole
    assert episode.prompt_ids + episode.ids == TOK.encode(whole, add_special_tokens=False)[:-1]


def test_environments_in_trl_convention_give_their_reward():
    _, episodes = _run(counting_script, reset_kwargs=[{"target": 2}, {"target": 4}])
    # rows 0, 2 add 1 twice (count 2), rows 1, 3 add 2 twice (count 4); targets 2 (prompt 0) and 4 (prompt 1)
    assert [e.env.count for e in episodes] == [2, 4, 2, 4]
    assert [e.env_reward for e in episodes] == [1.0, 0.0, 0.0, 1.0]
    assert len({id(e.env) for e in episodes}) == 4  # one instance per episode


def always_call(context, row, seed):
    return call_text("read", {})


def test_max_turns():
    _, episodes = _run(always_call, EpisodeLimits(max_turns=3))
    assert all(e.end_reason == "max_turns" and e.truncated and e.turns == 3 for e in episodes)
    assert all(len(e.tool_calls) == 2 for e in episodes)  # the last turn's call is not run: no turn would read it
    assert all(e.model_mask[-1] == 1 for e in episodes)


def test_max_tool_calls():
    def three(context, row, seed):
        return "".join(call_text("read", {}) for _ in range(3))

    _, episodes = _run(three, EpisodeLimits(max_tool_calls=4))
    assert all(e.end_reason == "max_tool_calls" and len(e.tool_calls) == 3 and e.turns == 2 for e in episodes)


def test_max_total_tokens():
    limits = EpisodeLimits(max_turns=50, max_total_tokens=300)
    _, episodes = _run(always_call, limits)
    for e in episodes:
        assert e.end_reason == "max_total_tokens" and e.truncated and len(e.ids) <= 300
    cut = EpisodeLimits(max_total_tokens=20)  # the first turn itself is cut at the budget
    _, episodes = _run(counting_script, cut)
    assert all(e.end_reason == "max_total_tokens" and len(e.ids) == 20 == sum(e.model_mask) for e in episodes)
    assert all(len(e.engine_logprobs) == 20 for e in episodes)


def test_a_turn_without_an_end_token_ends_the_episode():
    def long_turn(context, row, seed):
        return "thinking..." if row == 0 else "short"

    backend, episodes = _run(long_turn, n=1)
    assert [e.end_reason for e in episodes] == ["turn_length", "answer"]
    assert episodes[0].final_text == "thinking" and episodes[0].ids == TOK.encode("thinking", add_special_tokens=False)
    backend, episodes = _run(counting_script, n=1, max_new_tokens=10)  # the per-turn cap
    assert all(e.end_reason == "turn_length" and len(e.ids) == 10 for e in episodes)
    assert backend.calls[0][1].max_new_tokens == 10


def test_parse_failures_are_answered_or_end_the_episode():
    def sloppy(context, row, seed):
        if _responses(context) == 0:
            return '<tool_call>{"name": "increment", "arguments": {"step": "one"}}</tool_call>'
        return "ok"

    _, episodes = _run(sloppy, n=1)
    episode = episodes[0]
    assert episode.end_reason == "answer" and episode.turns == 2 and episode.tool_calls == []
    assert [f.reason for f in episode.parse_failures] == ["wrong_type"]
    shown = TOK.decode([t for t, m in zip(episode.ids, episode.model_mask, strict=True) if m == 0])
    assert "invalid tool call (block 1): wrong_type" in shown and "'step'" in shown
    _, episodes = _run(sloppy, EpisodeLimits(on_parse_failure="end"), n=1)
    assert episodes[0].end_reason == "parse_failure" and episodes[0].turns == 1 and not episodes[0].truncated


def test_a_hanging_tool_is_a_counted_error_inside_the_episode():
    release = threading.Event()

    class SlowEnv(CounterEnv):
        def wait(self, seconds: int) -> str:
            """Wait.

            Args:
                seconds: How long.
            """
            release.wait(seconds)
            return "done"

    def script(context, row, seed):
        return call_text("wait", {"seconds": 60}) if _responses(context) == 0 else "gave up"

    backend = ScriptedBackend(TOK, script)
    limits = EpisodeLimits(tool_timeout_s=0.2)
    episodes = run_episodes(backend, PROMPTS[:1], SlowEnv, TOK, SamplingParams(max_new_tokens=200, n=2), limits, 0)
    release.set()
    for e in episodes:
        assert e.end_reason == "answer" and e.tool_errors == 1 and e.tool_calls[0].timed_out
        assert "timed out after 0.2 s" in TOK.decode(e.ids)
    metrics = episode_metrics(episodes)
    assert metrics["tools/error_frac"] == 1.0 and metrics["tools/share/wait"] == 1.0


def random_script(context, row, seed):
    rng = random.Random(seed * 100 + row)
    if rng.random() < 0.5:
        return call_text("increment", {"step": rng.randint(1, 9)})
    return f"answer {rng.randint(0, 99)}"


def test_same_seed_same_episodes():
    def summary(episodes):
        return [(e.ids, e.model_mask, e.engine_logprobs, e.end_reason, [r.content for r in e.tool_calls])
                for e in episodes]

    limits = EpisodeLimits(max_turns=6)
    a, b, c = (summary(_run(random_script, limits, n=4, seed=s)[1]) for s in (3, 3, 4))
    assert a == b and a != c


def test_observations_need_their_own_prompts():
    class Greeting(CounterEnv):
        def reset(self, **kwargs):
            super().reset(**kwargs)
            return f" Target: {self.target}."

    with pytest.raises(ValueError, match="reset returned text for the user message"):
        run_episodes(ScriptedBackend(TOK, counting_script), PROMPTS, Greeting, TOK, SamplingParams(max_new_tokens=9),
                     EpisodeLimits(), 0)
    envs, observations = start_environments(Greeting, [{"target": 2}, {"target": 5}], n=2)
    assert observations == [" Target: 2."] * 2 + [" Target: 5."] * 2
    prompts = [encode_agent_prompt(TOK, "Count.", SCHEMAS, observation=o) for o in observations]
    backend = ScriptedBackend(TOK, counting_script)
    episodes = run_episodes(backend, prompts, None, TOK, SamplingParams(max_new_tokens=200), EpisodeLimits(), 0,
                            envs=envs)
    assert [e.env_reward for e in episodes] == [1.0, 0.0, 0.0, 0.0]  # counts 2, 4, 2, 4 against 2, 2, 5, 5
    assert "Target: 5." in TOK.decode(episodes[3].prompt_ids)
    with pytest.raises(ValueError, match="envs has 4 environments for 2 prompts x n=1"):
        run_episodes(backend, PROMPTS, None, TOK, SamplingParams(max_new_tokens=9), EpisodeLimits(), 0, envs=envs)


def test_standalone_tools_without_an_environment():
    from meshrl.agents import calculator

    def script(context, row, seed):
        if _responses(context) == 0:
            return call_text("calculator", {"expression": "2**70 + 1"})
        return "done"

    backend = ScriptedBackend(TOK, script)
    episodes = run_episodes(backend, PROMPTS[:1], None, TOK, SamplingParams(max_new_tokens=200), EpisodeLimits(), 0,
                            tools=[calculator])
    assert episodes[0].tool_calls[0].content == str(2**70 + 1) and episodes[0].env_reward is None


def test_metrics():
    def mixed(context, row, seed):
        if _responses(context) >= 1 + row % 2:
            return "done"
        return call_text("read", {}) + call_text("increment", {"step": 1}) if row % 2 else call_text("read", {})

    _, episodes = _run(mixed, EpisodeLimits(max_turns=2), n=2)
    # rows 0, 2: read, then answer (2 turns); rows 1, 3: read + increment, then a call at the last turn (max_turns)
    assert [e.end_reason for e in episodes] == ["answer", "max_turns", "answer", "max_turns"]
    metrics = episode_metrics(episodes)
    assert metrics == {"turns/mean": 2.0, "turns/limit_frac": 0.5, "tools/calls_mean": 1.5,
                       "tools/error_frac": 0.0, "tools/parse_fail_frac": 0.0,
                       "tools/share/increment": 2 / 6, "tools/share/read": 4 / 6}
    with pytest.raises(ValueError, match="at least one episode"):
        episode_metrics([])


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError, match="on_parse_failure must be 'respond' or 'end'"):
        EpisodeLimits(on_parse_failure="retry")
    for bad in ({"max_turns": "4"}, {"max_tool_calls": 2.5}, {"max_total_tokens": True}):  # built from Python
        with pytest.raises(ValueError, match="must be an int"):
            EpisodeLimits(**bad)
    for t in (float("inf"), float("nan"), "10", 0):
        with pytest.raises(ValueError, match="tool_timeout_s must be a finite number > 0"):
            EpisodeLimits(tool_timeout_s=t)
    assert EpisodeLimits(tool_timeout_s=2).tool_timeout_s == 2
    assert json.dumps(EpisodeLimits().__dict__)  # plain values: loggable as a config record


def test_a_turn_longer_than_its_episodes_room_is_cut_at_the_budget():
    """Turn 2 is one call for both episodes with max_new_tokens = the larger room; the other is cut to its own."""
    def script(context, row, seed):
        if _responses(context) == 0:
            return call_text("read", {}) + ("x" * 60 if row == 0 else "")
        return "y" * 150

    backend, episodes = _run(script, EpisodeLimits(max_total_tokens=220), n=2)
    room = [220 - e.turn_spans[1][0] for e in episodes[:2]]
    assert room[0] < room[1] and backend.calls[1][1].max_new_tokens == room[1]
    for e in episodes[:2]:
        assert len(e.ids) == 220 and e.end_reason == "max_total_tokens"
        assert e.model_mask[e.turn_spans[1][0]:] == [1] * (220 - e.turn_spans[1][0])
        assert len(e.engine_logprobs) == 220
