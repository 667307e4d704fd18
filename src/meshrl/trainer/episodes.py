"""Rollouts of a tool-using task (:class:`meshrl.tasks.env.EnvTask`): one multi-turn episode per sample.

Each row is what the single-turn sampler gives (``sampled_rows``) plus the episode's ``model_mask`` (1 on the
tokens the model sampled, 0 on tool output, which the update masks out of every term: ``StepData.response_masks``)
and ``env_reward``. The response is every token after the prompt, exactly as sampled and appended
(:func:`meshrl.agents.run_episodes`: never re-tokenised), and ``text`` the final model turn, which the data task
grades when the environment has no ``get_reward``. Rows are prompt-major, so a GRPO group is still the episodes
of one prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any


def sample_episodes(task: Any, backend: Any, tokenizer: Any, prompts: list[list[int]], problems: list[Any],
                    params: Any, seed: int, encode_with: Callable[[int, str], list[int]],
                    openings: list[list[int]] | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """``params.n`` episodes per prompt: ``(rows, episodes)``. An environment whose ``reset`` returns text gets it
    appended to its episode's user message (TRL's convention): ``encode_with(prompt_index, observation)`` builds
    that episode's prompt, and every episode then runs from its own prompt. ``openings[i]`` (``plugins.coach_guide``)
    are the token ids forced at the start of the first model turn of prompt ``i``'s episodes (row ``forced``: their
    count; the update treats them as the coach's, off-policy)."""
    from meshrl.agents import run_episodes, start_environments

    envs, episode_prompts, n, episode_openings = None, prompts, params.n, openings
    if task.factory is not None:
        envs, observations = start_environments(task.factory, [task.reset_kwargs(p) for p in problems], params.n)
        if any(obs is not None for obs in observations):
            episode_prompts = [encode_with(i // params.n, obs or "") for i, obs in enumerate(observations)]
            episode_openings = [openings[i // params.n] for i in range(len(observations))] if openings else None
            n = 1
    episodes = run_episodes(backend, episode_prompts, None, tokenizer, replace(params, n=n), task.limits, seed,
                            tools=task.tools, envs=envs, openings=episode_openings)
    rows = [{"prompt_index": i // params.n, "prompt_ids": list(e.prompt_ids), "response_ids": list(e.ids),
             "text": e.final_text, "truncated": e.truncated,
             "logps": None if e.engine_logprobs is None else list(e.engine_logprobs),
             "forced": len(openings[i // params.n]) if openings else 0,
             "model_mask": list(e.model_mask), "env_reward": e.env_reward, "transcript": transcript(tokenizer, e)}
            for i, e in enumerate(episodes)]
    return rows, episodes


def transcript(tokenizer: Any, episode: Any) -> str:
    """The model's turns of an episode, tool calls included and tool output left out, one per line: what the
    strategy labeller of a tool-using task reads (:meth:`meshrl.tasks.env.EnvTask.label_strategy`)."""
    return "\n".join(tokenizer.decode(episode.ids[a:b], skip_special_tokens=True) for a, b in episode.turn_spans)


def check_episodic_config(cfg: Any) -> None:
    """Settings that cannot act on multi-turn episodes, refused by key before any rollout."""
    p = cfg.plugins
    for name in ("luffy", "ssd", "opsd", "remix", "calib"):  # coach_guide forces the first turn's opening
        section = getattr(p, name, None)
        if section is not None and getattr(section, "enabled", False):
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
