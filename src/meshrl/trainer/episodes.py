"""Rollouts of a tool-using task (:class:`meshrl.agents.EnvTask`): one multi-turn episode per sample.

Each row is what the single-turn sampler gives (``sampled_rows``) plus the episode's ``model_mask`` (1 on the
tokens the model sampled, 0 on tool output, which the update masks out of every term: ``StepData.response_masks``)
and ``env_reward``. The response is every token after the prompt, exactly as sampled and appended
(:func:`meshrl.agents.run_episodes`: never re-tokenised), and ``text`` the final model turn, which the data task
grades when the environment has no ``get_reward``. Rows are prompt-major, so a GRPO group is still the episodes
of one prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

log = logging.getLogger("meshrl")


def sample_episodes(task: Any, backend: Any, tokenizer: Any, prompts: list[list[int]], problems: list[Any],
                    params: Any, seed: int, encode_with: Callable[[int, str], list[int]],
                    openings: list[list[int]] | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """``params.n`` episodes per prompt: ``(rows, episodes)``. An environment whose ``reset`` returns text gets it
    appended to its episode's user message (TRL's convention): ``encode_with(prompt_index, observation)`` builds
    that episode's prompt, and every episode then runs from its own prompt. ``openings[i]`` (``plugins.coach_guide``)
    are the token ids forced at the start of the first model turn of prompt ``i``'s episodes (row ``forced``: their
    count; the update treats them as the coach's, off-policy)."""
    from meshrl.agents import run_episodes, start_environments

    envs, episode_prompts, n, episode_openings, cuts = None, prompts, params.n, openings, []
    if task.factory is not None:
        envs, observations = start_environments(task.factory, [task.reset_kwargs(p) for p in problems], params.n)
        if any(obs is not None for obs in observations):
            fit = ObservationFit(tokenizer, context_limit_of(backend, tokenizer), params.max_new_tokens)
            built = [fit.prompt(lambda text, i=i: encode_with(i // params.n, text), obs or "",
                                getattr(problems[i // params.n], "id", i // params.n))
                     for i, obs in enumerate(observations)]
            episode_prompts, cuts = [ids for ids, _ in built], [cut for _, cut in built]
            episode_openings = [openings[i // params.n] for i in range(len(observations))] if openings else None
            n = 1
    ids = [str(getattr(problems[i // params.n], "id", i // params.n)) for i in range(len(problems) * params.n)]
    episodes = run_episodes(backend, episode_prompts, None, tokenizer, replace(params, n=n), task.limits, seed,
                            tools=task.tools, envs=envs, openings=episode_openings, problem_ids=ids)
    for episode, cut in zip(episodes, cuts, strict=False):
        episode.observation_cut = cut
    rows = [{"prompt_index": i // params.n, "prompt_ids": list(e.prompt_ids), "response_ids": list(e.ids),
             "text": e.final_text, "truncated": e.truncated,
             "logps": None if e.engine_logprobs is None else list(e.engine_logprobs),
             "forced": len(openings[i // params.n]) if openings else 0,
             "model_mask": list(e.model_mask), "env_reward": e.env_reward, "transcript": transcript(tokenizer, e)}
            for i, e in enumerate(episodes)]
    return rows, episodes


def context_limit_of(backend: Any, tokenizer: Any) -> int | None:
    """The positions of the backend's model (:func:`meshrl.trainer.rollout_step.context_limit`), ``None`` when the
    backend holds no model or neither it nor the tokenizer states a limit."""
    from meshrl.trainer.rollout_step import context_limit

    return context_limit(backend.model, tokenizer)


class ObservationFit:
    """Episode prompts with a ``reset`` observation in them, held to the prompt-length rule of the trainer's own
    prompts (prompt tokens + ``max_new_tokens`` within the model's ``limit`` positions) and encoded as text.

    An observation is environment text: its surrogates become U+FFFD, and one that spells a special token
    (``<|im_end|>``) is encoded on its own as plain text (:func:`meshrl.agents.tool_calls.encode_as_text`) and
    spliced where the prompt holds it; ordinary observations encode exactly as before. An observation too long for
    the model is cut, with a note the model reads and a warning naming the problem (bounded work: a head of
    ``16 x limit`` characters is the most any tokenizer can fit), instead of asking the decoder for a cache the
    size of the whole text."""

    NOTE = "\n[observation cut: {} more characters]"

    def __init__(self, tokenizer: Any, limit: int | None, max_new_tokens: int) -> None:
        self.tokenizer, self.limit, self.max_new_tokens = tokenizer, limit, max_new_tokens
        self.warned: set[Any] = set()  # problems already logged (each of a group's episodes has its observation)

    def prompt(self, encode: Callable[[str], list[int]], observation: str, problem_id: Any) -> tuple[list[int], int]:
        """``(prompt ids, characters of the observation cut)`` for ``encode(observation)``."""
        from meshrl.agents.tool_calls import as_text
        from meshrl.trainer.rollout_step import PROBE_CHARS_PER_POSITION

        text = as_text(observation)
        if self.limit is None:
            return self._encode(encode, text), 0
        keep = min(len(text), PROBE_CHARS_PER_POSITION * self.limit)
        for _ in range(8):  # cut by the measured excess (at least 10%) and measure again: a few tries suffice
            shown = text if keep >= len(text) else text[:keep] + self.NOTE.format(len(text) - keep)
            ids = self._encode(encode, shown)
            excess = len(ids) + self.max_new_tokens - self.limit
            if excess <= 0:
                break
            keep = max(0, min(keep - excess, int(keep * 0.9)))
        else:
            keep, ids = 0, self._encode(encode, self.NOTE.format(len(text)))
        if keep < len(text) and problem_id not in self.warned:
            self.warned.add(problem_id)
            log.warning("problem %r: its environment's reset observation has %d characters, too long for the "
                        "model's %d positions with max_new_tokens=%d; the model sees its first %d", problem_id,
                        len(text), self.limit, self.max_new_tokens, keep)
        return ids, len(text) - keep

    def _encode(self, encode: Callable[[str], list[int]], text: str) -> list[int]:
        from meshrl.agents.tool_calls import encode_around

        return encode_around(encode, self.tokenizer, text)


def transcript(tokenizer: Any, episode: Any) -> str:
    """The model's turns of an episode, tool calls included and tool output left out, one per line: what the
    strategy labeller of a tool-using task reads (:meth:`meshrl.agents.EnvTask.label_strategy`)."""
    return "\n".join(tokenizer.decode(episode.ids[a:b], skip_special_tokens=True) for a, b in episode.turn_spans)


def check_episodic_config(cfg: Any) -> None:
    """Settings that cannot act on multi-turn episodes, refused by key before any rollout."""
    from meshrl.trainer.plugins import REGISTRY

    for name, cls in REGISTRY.items():  # the plug-ins that declare ``episodes_ok = False``
        section = getattr(cfg.plugins, name, None)
        if not cls.episodes_ok and section is not None and cls.is_enabled(section):
            raise ValueError(f"plugins.{name}.enabled: not available with a tool-using task (env:...): it reads "
                             "each response as one sampled stream, and an episode interleaves tool output")


def generate_scored(task: Any, backend: Any, tokenizer: Any, prompts: list[list[int]], problems: list[Any],
                    params: Any, seed: int, reward_runner: Any, encode_with: Callable[[int, str], list[int]]
                    ) -> tuple[list[str], list[Any], list[float], list[bool], list[Any]]:
    """Samples of ``prompts`` (``problems[i]`` is prompt ``i``'s problem) with their scores, for an evaluation:
    ``(texts, problem per sample, scores, truncated, episodes)``. One completion per sample for a plain task (no
    episodes); for a tool-using task, an episode per sample (its final turn is the text, scored by the environment's
    ``get_reward`` or the data's grader)."""
    if not getattr(task, "episodic", False):
        out = backend.generate(prompts, params, seed=seed)
        probs = [problems[i] for i in out.prompt_index]
        return list(out.texts), probs, list(reward_runner(out.texts, probs)), list(out.truncated), []

    rows, episodes = sample_episodes(task, backend, tokenizer, prompts, problems, params, seed, encode_with)
    texts = [r["text"] for r in rows]
    probs = [problems[r["prompt_index"]] for r in rows]
    scores = ([float(r["env_reward"]) for r in rows] if task.owns_reward else list(reward_runner(texts, probs)))
    return texts, probs, scores, [bool(r["truncated"]) for r in rows], episodes
