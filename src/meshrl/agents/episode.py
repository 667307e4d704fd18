"""Token-exact multi-turn episodes: the model's turns, tool calls, and the tool results between them.

:func:`run_episodes` samples ``params.n`` first turns per prompt with one ``backend.generate`` call; then each
episode continues on its own: the model turn's tool calls are parsed (:func:`parse_tool_calls`), executed
(:func:`execute_call`), their results rendered as the chat template would (:class:`ToolResponseRenderer`) and
encoded once, and the next turn is sampled from the exact ids so far, ``prompt + model turn + tool tokens +
...``. The model's sampled ids are never decoded and encoded again, so the ids the trainer would score are
the ids the engine sampled from (no re-tokenisation drift). Every later turn is one ``generate`` call for
all episodes still running (``n = 1`` each), with seed :func:`turn_seed` ``(seed, turn)``.

An episode ends with ``end_reason``:

* ``answer``: a model turn without tool calls;
* ``parse_failure``: a turn whose tool-call markup is refused, when ``limits.on_parse_failure == "end"``
  (by default the refusal is sent back as a tool response and the episode goes on);
* the limits (``truncated`` is True): ``max_turns`` (a turn calls tools but no turn is left), ``max_tool_calls``
  (a turn's calls would pass the episode's budget; none of them runs), ``max_total_tokens`` (the model's turn
  was cut at the budget, or the tool results would leave no room for a next turn), ``turn_length`` (the turn
  reached ``params.max_new_tokens`` without an end-of-turn token).

``params.max_new_tokens`` caps each turn; ``limits.max_total_tokens`` caps all ids after the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from meshrl.agents.environment import Toolbox, environment_reward, reset_environment
from meshrl.agents.execute import ToolResult, execute_call
from meshrl.agents.tool_calls import (
    ParsedTurn,
    ParseFailure,
    ToolResponseRenderer,
    parse_tool_calls,
    tool_result_text,
)
from meshrl.rollout.base import RolloutBackend, Rollouts, SamplingParams

LIMIT_REASONS = ("max_turns", "max_tool_calls", "max_total_tokens", "turn_length")
END_REASONS = ("answer", "parse_failure", *LIMIT_REASONS)
PARSE_FAILURE_TOOL = "invalid_tool_call"  # the tool name on the response that reports a refused turn


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits: turns (model turns), executed tool calls, tokens after the prompt (model and tool
    tokens), the time limit and output cap of one tool call, and what a refused tool-call turn does
    (``"respond"``: the refusal goes back to the model as a tool response; ``"end"``: the episode ends)."""

    max_turns: int = 4
    max_tool_calls: int = 8
    max_total_tokens: int = 1024
    tool_timeout_s: float = 10.0
    max_tool_output_chars: int = 4000
    on_parse_failure: str = "respond"

    def __post_init__(self) -> None:
        # Built from Python as well as from settings: the types are checked here too (a "4" or a 2.5 for a count
        # would fail deep inside an episode, an inf or NaN time limit would never fire).
        for name in ("max_turns", "max_tool_calls", "max_total_tokens", "max_tool_output_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"EpisodeLimits.{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"EpisodeLimits.{name} must be >= 1, got {value}")
        t = self.tool_timeout_s
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"EpisodeLimits.tool_timeout_s must be a finite number > 0, got {t!r}")
        if self.on_parse_failure not in ("respond", "end"):
            raise ValueError("EpisodeLimits.on_parse_failure must be 'respond' or 'end', got "
                             f"{self.on_parse_failure!r}")


@dataclass(frozen=True)
class ToolCallRecord:
    """One executed call: the model ``turn`` (1-based) that made it, the call, and its result."""

    turn: int
    name: str
    arguments: dict[str, Any]
    content: str
    error: str | None
    timed_out: bool
    duration_s: float


@dataclass
class Episode:
    """One episode. ``ids`` are all tokens after the prompt; ``model_mask[t]`` is 1 where the model sampled
    ``ids[t]``, 0 on tool-response tokens; ``engine_logprobs`` is aligned with ``ids`` (the backend's log-prob on
    model tokens, 0.0 on tool tokens, which the mask excludes), ``None`` when the backend returns none;
    ``turn_spans`` are the ``[start, stop)`` ranges of the model turns in ``ids``. ``env_reward`` is the
    environment's ``get_reward()`` after the episode, when it defines one; ``observation_cut`` the characters of
    its ``reset`` observation left out of the prompt to fit the model (``meshrl.trainer.episodes``; ``None`` when
    there was no observation)."""

    prompt_index: int
    prompt_ids: list[int]
    toolbox: Toolbox
    ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    engine_logprobs: list[float] | None = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    parse_failures: list[ParseFailure] = field(default_factory=list)
    end_reason: str | None = None
    final_text: str = ""
    env_reward: float | None = None
    observation_cut: int | None = None  # characters of the reset observation cut to fit the model; None: none

    @property
    def env(self) -> Any:
        return self.toolbox.env

    @property
    def turns(self) -> int:
        return len(self.turn_spans)

    @property
    def truncated(self) -> bool:
        """True when a limit ended the episode (:data:`LIMIT_REASONS`)."""
        return self.end_reason in LIMIT_REASONS

    @property
    def tool_errors(self) -> int:
        return sum(record.error is not None for record in self.tool_calls)

    def append(self, ids: Sequence[int], *, model: bool, logprobs: Sequence[float] | None = None) -> None:
        """Append ``ids``: model-sampled (mask 1, their engine log-probs) or environment tokens (mask 0)."""
        self.ids.extend(ids)
        self.model_mask.extend([1 if model else 0] * len(ids))
        if self.engine_logprobs is not None:
            if model and logprobs is None:
                self.engine_logprobs = None
            else:
                self.engine_logprobs.extend(list(logprobs) if model else [0.0] * len(ids))


def turn_seed(seed: int, turn: int) -> int:
    """The ``generate`` seed of turn ``turn`` (0-based) of a batch of episodes run with ``seed``."""
    return (seed * 1_000_003 + turn) % (2**31 - 1)


def start_environments(env_factory: Callable[[], Any], reset_kwargs: Sequence[dict[str, Any]], n: int
                       ) -> tuple[list[Any], list[str | None]]:
    """``n`` fresh environments per prompt (prompt-major), each reset with its prompt's ``reset_kwargs``, and
    what each ``reset`` returned. For environments whose ``reset`` returns text: build each episode's prompt with
    :func:`meshrl.agents.tool_calls.encode_agent_prompt` from it and pass ``envs=`` to :func:`run_episodes`."""
    envs, observations = [], []
    for kwargs in reset_kwargs:
        for _ in range(n):
            env = env_factory()
            observations.append(reset_environment(env, **kwargs))
            envs.append(env)
    return envs, observations


def _make_episodes(prompt_ids: list[list[int]], n: int, env_factory: Callable[[], Any] | None,
                   tools: Sequence[Callable[..., Any]], reset_kwargs: Sequence[dict[str, Any]] | None,
                   envs: Sequence[Any] | None) -> list[Episode]:
    if envs is None and env_factory is not None:
        kwargs = list(reset_kwargs) if reset_kwargs is not None else [{} for _ in prompt_ids]
        if len(kwargs) != len(prompt_ids):
            raise ValueError(f"reset_kwargs has {len(kwargs)} entries for {len(prompt_ids)} prompts")
        envs, observations = start_environments(env_factory, kwargs, n)
        if any(obs is not None for obs in observations):
            raise ValueError(
                f"{type(envs[0]).__qualname__}.reset returned text for the user message, which token-level prompts "
                "cannot take: call start_environments(...), build each prompt with encode_agent_prompt(..., "
                "observation=...), and pass envs= (one prompt per episode, params.n = 1)")
    if envs is not None and len(envs) != len(prompt_ids) * n:
        raise ValueError(f"envs has {len(envs)} environments for {len(prompt_ids)} prompts x n={n}")
    return [Episode(prompt_index=i // n, prompt_ids=list(prompt_ids[i // n]),
                    toolbox=Toolbox(envs[i] if envs is not None else None, tools))
            for i in range(len(prompt_ids) * n)]


def run_episodes(backend: RolloutBackend, prompt_ids: list[list[int]], env_factory: Callable[[], Any] | None,
                 tokenizer, params: SamplingParams, limits: EpisodeLimits, seed: int, *,
                 tools: Sequence[Callable[..., Any]] = (), reset_kwargs: Sequence[dict[str, Any]] | None = None,
                 envs: Sequence[Any] | None = None, chat_template_kwargs: dict | None = None,
                 tool_workers: int = 8, openings: Sequence[Sequence[int]] | None = None,
                 problem_ids: Sequence[str] | None = None) -> list[Episode]:
    """Run ``params.n`` episodes per prompt (prompt-major: the ``n`` of prompt 0 first), see the module docstring.

    ``env_factory`` makes one environment per episode (TRL's convention; ``None``: only standalone ``tools``),
    reset with ``reset_kwargs[i]`` for prompt ``i`` (default: no arguments). ``envs`` passes environments made
    and reset by the caller instead (:func:`start_environments`), ``len(prompt_ids) * params.n`` of them.
    ``tools`` are standalone tool functions every episode may call as well (:mod:`meshrl.agents.execute` has
    built-in ones). ``prompt_ids`` should show the tools to the model (:func:`encode_agent_prompt`).

    After each turn the episodes' tool calls run in up to ``tool_workers`` threads, one episode per thread (an
    episode's own calls in order, as its environment's state may depend on it); results are recorded in episode
    order, so the outcome does not depend on which thread finishes first.

    ``openings[i]`` (coach-guided exploration, ``plugins.coach_guide``): token ids every episode of prompt ``i``
    starts its first model turn with, forced rather than sampled (:func:`first_turn`). They count as the model's
    tokens (mask 1), within the turn's ``max_new_tokens``; a guided episode has no engine log-probs (``None``),
    since the engine did not choose its opening. An empty opening is a free episode.

    ``problem_ids[i]`` names episode ``i``'s problem in the message of a failed ``get_reward``.
    """
    if tool_workers < 1:
        raise ValueError(f"tool_workers must be >= 1, got {tool_workers}")
    episodes = _make_episodes(prompt_ids, params.n, env_factory, tools, reset_kwargs, envs)
    renderer = ToolResponseRenderer(tokenizer, chat_template_kwargs)
    with ThreadPoolExecutor(max_workers=tool_workers, thread_name_prefix="episode-tools") as pool:
        first = first_turn(backend, prompt_ids, _turn_params(params, params.n, limits.max_total_tokens), seed,
                           openings)
        _check_rows(first, len(episodes), "turn 1")
        _advance(episodes, first, tokenizer, renderer, limits, pool)
        turn = 1
        while live := [episode for episode in episodes if episode.end_reason is None]:
            room = max(limits.max_total_tokens - len(episode.ids) for episode in live)
            contexts = [episode.prompt_ids + episode.ids for episode in live]
            out = backend.generate(contexts, _turn_params(params, 1, room), seed=turn_seed(seed, turn))
            _check_rows(out, len(live), f"turn {turn + 1}")
            _advance(live, out, tokenizer, renderer, limits, pool)
            turn += 1
    for i, episode in enumerate(episodes):
        if episode.env is not None:
            episode.env_reward = environment_reward(episode.env, problem_ids[i] if problem_ids else None)
    return episodes


def first_turn(backend: RolloutBackend, prompt_ids: list[list[int]], params: SamplingParams, seed: int,
               openings: Sequence[Sequence[int]] | None) -> Rollouts:
    """The first model turn of every episode (prompt-major, ``params.n`` per prompt). Without openings: one
    ``generate`` call with seed ``turn_seed(seed, 0)``. With them, one call per opening length ``L`` from
    ``prompt + opening`` with ``max_new_tokens - L`` new tokens (seed ``turn_seed(seed, 0) + 7919 L``, so the free
    prompts keep the plain call's seed), the opening put back in front of each response; a guided row's
    log-probs are ``None``."""
    if not openings or not any(openings):
        return backend.generate(prompt_ids, params, seed=turn_seed(seed, 0))
    if len(openings) != len(prompt_ids):
        raise ValueError(f"openings has {len(openings)} entries for {len(prompt_ids)} prompts")
    by_len: dict[int, list[int]] = {}
    for i, opening in enumerate(openings):
        if len(opening) >= params.max_new_tokens:
            raise ValueError(f"the opening of prompt {i} is {len(opening)} tokens, not less than the turn's "
                             f"max_new_tokens={params.max_new_tokens}")
        by_len.setdefault(len(opening), []).append(i)
    rows: dict[int, list[tuple[list[int], bool, list[float] | None]]] = {}
    for length, members in sorted(by_len.items()):
        out = backend.generate([list(prompt_ids[i]) + list(openings[i]) for i in members],
                               replace(params, max_new_tokens=params.max_new_tokens - length),
                               seed=turn_seed(seed, 0) + 7919 * length)
        for r, index in enumerate(out.prompt_index):
            i = members[index]
            logps = list(out.engine_logprobs[r]) if out.engine_logprobs is not None and not length else None
            rows.setdefault(i, []).append((list(openings[i]) + list(out.response_ids[r]), out.truncated[r], logps))
    merged = Rollouts(engine_logprobs=[])
    for i in range(len(prompt_ids)):
        for response, truncated, logps in rows.get(i, []):
            merged.prompt_index.append(i)
            merged.prompt_ids.append(list(prompt_ids[i]))
            merged.response_ids.append(response)
            merged.texts.append("")  # unused: each turn is decoded from its ids (_take_turn)
            merged.truncated.append(truncated)
            merged.engine_logprobs.append(logps)  # type: ignore[arg-type]  (None: a guided row)
    return merged


def _turn_params(params: SamplingParams, n: int, room: int) -> SamplingParams:
    return replace(params, n=n, max_new_tokens=max(1, min(params.max_new_tokens, room)))


def _check_rows(rollouts: Rollouts, expected: int, where: str) -> None:
    if len(rollouts) != expected:
        raise RuntimeError(f"the rollout backend returned {len(rollouts)} samples at {where}, expected {expected}")


def _advance(episodes: list[Episode], rollouts: Rollouts, tokenizer, renderer: ToolResponseRenderer,
             limits: EpisodeLimits, pool: ThreadPoolExecutor) -> None:
    """One turn for ``episodes`` (row ``i`` of ``rollouts`` is ``episodes[i]``'s): append the model turns, run
    the calls of those that continue (concurrently across episodes), append the rendered results."""
    pending = [(episode, parsed) for row, episode in enumerate(episodes)
               if (parsed := _take_turn(episode, rollouts, row, tokenizer, limits)) is not None]
    results = list(pool.map(lambda item: _run_calls(item[0], item[1], limits), pending))
    for (episode, parsed), executed in zip(pending, results, strict=True):
        if parsed.failure is not None:
            responses = [(PARSE_FAILURE_TOOL, tool_result_text({"error": parsed.failure.message()}))]
        else:
            responses = []
            for call, result in zip(parsed.calls, executed, strict=True):
                episode.tool_calls.append(ToolCallRecord(episode.turns, call.name, call.arguments, result.content,
                                                         result.error, result.timed_out, result.duration_s))
                responses.append((call.name, result.content))
        suffix = renderer.ids(responses)
        if len(episode.ids) + len(suffix) >= limits.max_total_tokens:
            episode.end_reason = "max_total_tokens"  # no room left for a next model token
            continue
        episode.append(suffix, model=False)


def _run_calls(episode: Episode, parsed: ParsedTurn, limits: EpisodeLimits) -> list[ToolResult]:
    return [execute_call(episode.toolbox, call, timeout_s=limits.tool_timeout_s,
                         max_output_chars=limits.max_tool_output_chars) for call in parsed.calls]


def _take_turn(episode: Episode, rollouts: Rollouts, row: int, tokenizer, limits: EpisodeLimits
               ) -> ParsedTurn | None:
    """Append the model turn ``rollouts[row]`` to ``episode``; return its parsed calls (or its parse failure,
    to be answered) when the episode goes on, else set ``end_reason`` and return ``None``."""
    response = rollouts.response_ids[row]
    logprobs = rollouts.engine_logprobs[row] if rollouts.engine_logprobs is not None else None
    room = limits.max_total_tokens - len(episode.ids)
    cut = len(response) > room
    if cut:
        response, logprobs = response[:room], (logprobs[:room] if logprobs is not None else None)
    start = len(episode.ids)
    episode.append(response, model=True, logprobs=logprobs)
    episode.turn_spans.append((start, len(episode.ids)))
    ended_turn = not rollouts.truncated[row] and not cut  # its last token is the end-of-turn token
    episode.final_text = tokenizer.decode(response[:-1] if ended_turn else response, skip_special_tokens=False)
    if not ended_turn:  # the budget or the turn cap stopped it mid-turn
        episode.end_reason = "max_total_tokens" if len(episode.ids) >= limits.max_total_tokens else "turn_length"
        return None
    parsed = parse_tool_calls(episode.final_text, {n: t.parameters for n, t in episode.toolbox.tools.items()})
    if parsed.failure is not None:
        episode.parse_failures.append(parsed.failure)
        if limits.on_parse_failure == "end":
            episode.end_reason = "parse_failure"
    elif not parsed.calls:
        episode.end_reason = "answer"
    elif len(episode.tool_calls) + len(parsed.calls) > limits.max_tool_calls:
        episode.end_reason = "max_tool_calls"
    if episode.end_reason is None and episode.turns >= limits.max_turns:  # no turn left to read the results
        episode.end_reason = "max_turns"
    return parsed if episode.end_reason is None else None
