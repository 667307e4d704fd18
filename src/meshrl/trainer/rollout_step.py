"""One step's data: choose problems, sample G rollouts each, grade them, shape rewards, advantages.

Problem order is a pure function of ``(seed, cursor)`` (an epoch-wise permutation), so a resumed run
sees exactly the problems the uninterrupted run would have seen. A problem whose prompt leaves no room for
``rollout.max_new_tokens`` in the model's positions is skipped (its cursor position consumed, so resumes
still agree), logged once with its id and counted in the step's ``skipped/long_prompts``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from meshrl.algos import Recipe, dynamic_sampling_mask
from meshrl.runs.correct import is_correct
from meshrl.trainer.scoring import Scoring
from meshrl.trainer.step_data import Sample, StepData

log = logging.getLogger("meshrl")
# Prompts longer than this many characters per model position are measured from their head first: no
# tokenizer averages more characters per token, so a head already past the limit settles it cheaply.
PROBE_CHARS_PER_POSITION = 16


def context_limit(model, tokenizer) -> int | None:
    """The model's positions (``config.max_position_embeddings``, else the tokenizer's ``model_max_length``
    when it is a real bound), or ``None`` when neither states one."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0:
        return limit
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**8 else None  # HF uses 1e30 for "unknown"


class PromptBudget:
    """Which prompts fit: prompt tokens + ``max_new_tokens`` must not exceed the model's ``limit`` positions
    (past them the decoder would index beyond its position table, or preallocate a cache for the whole
    prompt). Remembers each too-long problem (id -> prompt tokens) and logs it once."""

    def __init__(self, limit: int | None, max_new_tokens: int, setting: str = "rollout.max_new_tokens") -> None:
        if limit is not None and max_new_tokens >= limit:
            raise ValueError(f"{setting}={max_new_tokens} leaves no room for a prompt in the model's {limit} "
                             f"positions")
        self.limit, self.max_new_tokens, self.setting = limit, max_new_tokens, setting
        self.too_long: dict[str, int] = {}

    def fits(self, problem_id: str, prompt_tokens: int) -> bool:
        if self.limit is None or prompt_tokens + self.max_new_tokens <= self.limit:
            return True
        if problem_id not in self.too_long:
            log.warning("problem %r skipped: its prompt has %d tokens (or more), and with %s=%d that exceeds the "
                        "model's %d positions", problem_id, prompt_tokens, self.setting, self.max_new_tokens,
                        self.limit)
        self.too_long[problem_id] = prompt_tokens
        return False


def strategy_figures(task, samples: list[tuple[str, float, Any]], prefix: str = "") -> dict[str, float]:
    """Strategy masses and accuracy per problem type of ``(text, score, problem)`` samples.

    For tasks with a strategy parser (``task.strategies``, ``task.label_strategy``): the share of each
    strategy, the unlabelled share, the max share among labelled samples and the mean over problems of the
    per-problem max share (``strategy/...``); for problems with ``meta["type"]``: the share correct per type
    (``acc/type/<t>``). Keys carry ``prefix`` (``"eval/"`` for held-out samples).
    """
    out: dict[str, float] = {}
    if not samples:
        return out
    names = getattr(task, "strategies", ())
    if names:
        labels = [task.label_strategy(text) for text, _, _ in samples]
        labelled = [x for x in labels if x is not None]
        for name in names:
            out[f"{prefix}strategy/mass/{name}"] = labels.count(name) / len(labels)
        out[f"{prefix}strategy/unlabelled"] = 1 - len(labelled) / len(labels)
        out[f"{prefix}strategy/max_mass"] = max(labelled.count(n) for n in names) / len(labelled) if labelled else 0.0
        per_problem: dict[str, list[str]] = {}
        for (_, _, problem), lab in zip(samples, labels, strict=True):
            if lab is not None:
                per_problem.setdefault(problem.id, []).append(lab)
        if per_problem:
            out[f"{prefix}strategy/problem_max_mass"] = sum(
                max(v.count(n) for n in names) / len(v) for v in per_problem.values()) / len(per_problem)
    by_type: dict[str, list[float]] = {}
    for _, score, problem in samples:
        if "type" in problem.meta:
            by_type.setdefault(str(problem.meta["type"]), []).append(float(is_correct(score)))
    for t, v in sorted(by_type.items()):
        out[f"{prefix}acc/type/{t}"] = sum(v) / len(v)
    return out


def long_head_ids(encode: Callable[[str], list[int]], text: str, limit: int | None) -> list[int] | None:
    """``encode`` of the head of a very long ``text`` when that head alone is already past ``limit`` positions (the
    whole prompt is at least ``len(head) - 1`` tokens: the skip is settled with bounded work for a 1M-character
    problem); None when the text must be encoded whole."""
    if limit is None or len(text) <= PROBE_CHARS_PER_POSITION * limit:
        return None
    head = encode(text[: PROBE_CHARS_PER_POSITION * limit])
    return list(head) if len(head) > limit + 1 else None


def encode_within_limit(encode_prompt, tokenizer, text: str, limit: int | None) -> list[int]:
    """The prompt's token ids, or only its head's when the head alone is already past ``limit`` positions."""
    head = long_head_ids(lambda t: encode_prompt(tokenizer, t), text, limit)
    return head if head is not None else encode_prompt(tokenizer, text)


class ProblemStream:
    """Deterministic epoch-wise shuffled stream of problem indices, addressed by a cursor."""

    def __init__(self, n: int, seed: int) -> None:
        if n == 0:
            raise ValueError("the task has no training problems")
        self.n, self.seed = n, seed
        self._perms: dict[int, np.ndarray] = {}

    def index(self, cursor: int) -> int:
        epoch, pos = divmod(cursor, self.n)
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return int(self._perms[epoch][pos])


class RolloutStep:
    """Produce a :class:`StepData` per step: problems from the :class:`ProblemStream`, their prompts (coach
    arms, forced openings), rollouts from the backend, then :class:`meshrl.trainer.scoring.Scoring` (grades,
    shaped rewards, advantages) and dynamic sampling."""

    # ``features=True`` for the backend on a step that computes MEI (:meth:`features_wanted`); reassigned, never
    # mutated, so the class-level default is shared safely (also by a sampler built without ``__init__``).
    _features: dict[str, bool] = {}
    # The plug-in that forces the coach arms' response openings (Plugin.opening), if one is enabled: set by the
    # trainer once the plug-ins exist (TrainPlugins.opener).
    opener: Any = None

    def __init__(self, *, task, problems, backend, tokenizer, reward_runner, recipe: Recipe, cfg,
                 encode_prompt, prefixes: dict[str, list[str]] | None = None) -> None:
        self.task, self.problems, self.backend = task, problems, backend
        self.tokenizer, self.rewards, self.recipe, self.cfg = tokenizer, reward_runner, recipe, cfg
        self.problem_stream = ProblemStream(len(problems), cfg.seed)  # which problem each cursor position is
        self.budget = PromptBudget(context_limit(backend.model, tokenizer),
                                   cfg.rollout.max_new_tokens)
        self._prompt_cache: dict[tuple[str, int], list[int]] = {}
        self._encode = encode_prompt
        self.prefixes = prefixes  # problem id -> m coach prefixes (Mesh recipes only)
        self.scoring = Scoring(task=task, reward_runner=reward_runner, recipe=recipe,
                               max_new_tokens=cfg.rollout.max_new_tokens, prefixes=prefixes)
        self.last = StepData()
        self.episodes: list[Any] = []  # this step's tool-using episodes (an env task), for their metrics

    def conditioning(self, problem, strategy: int) -> dict[str, str]:
        """``{"system": text}`` or ``{"assistant_prefix": text}``: the coach prefix of a rollout, wrapped in
        the anti-hacking template unless ``mesh.template`` is ``plain`` (small models trained on bare
        prefixes, such as the testbed's warm start, cannot read an 800-character template)."""
        from meshrl.mesh import wrap_prefix

        placement = self.cfg.mesh.placement
        prefix = self.prefixes[problem.id][strategy]
        wrapped = prefix if self.cfg.mesh.template == "plain" else wrap_prefix(prefix, placement)
        return {"system": wrapped} if placement == "system" else {"assistant_prefix": wrapped}

    def prompt_ids(self, problem, strategy: int = -1) -> list[int]:
        """Token ids of the prompt, conditioned on coach prefix ``strategy`` when it is >= 0.

        With the ``assistant`` placement the prefix ends the prompt, so it is never part of the response and
        its tokens are outside every loss term by construction.
        """
        key = (problem.id, strategy)
        if key not in self._prompt_cache:
            text = self.task.format_prompt(problem)
            extra = self.conditioning(problem, strategy) if strategy >= 0 else {}
            self._prompt_cache[key] = self._encode(self.tokenizer, text, **extra)
        return self._prompt_cache[key]

    def _arms(self, chosen: list) -> tuple[list[tuple[int, int]], int]:
        """(problem position, strategy) per prompt, and samples per prompt (the rollout budget)."""
        g = self.cfg.rollout.group_size
        if self.prefixes is None:
            return [(j, -1) for j in range(len(chosen))], g
        from meshrl.mesh import budget_groups

        m, bare = self.cfg.mesh.m, self.cfg.mesh.bare_group
        # Each bare group (strategy -1: no prefix) is one more group of the same size as a prefix group.
        nb = self.cfg.mesh.bare_groups if bare else 0
        n = budget_groups(g, m + nb, self.cfg.mesh.budget)[0]
        strategies = [*range(m), *[-1] * nb]
        return [(j, k) for j in range(len(chosen)) for k in strategies], n

    def _fits(self, problem) -> bool:
        """Whether every prompt of ``problem`` (each coach prefix, the bare one) fits the model's positions."""
        arms, _ = self._arms([problem])
        return all(self.budget.fits(problem.id, self._prompt_tokens(problem, self._prompt_arm(k))) for _, k in arms)

    @property
    def guided(self) -> bool:
        """Whether a plug-in forces the coach arms' response openings (:attr:`opener`): the coach arms then sample
        the unconditioned prompt and open the *response* with the coach's strategy instead."""
        return self.prefixes is not None and self.opener is not None

    def _prompt_arm(self, strategy: int) -> int:
        """The prompt a rollout of coach arm ``strategy`` is sampled under (-1: the unconditioned prompt)."""
        return -1 if self.guided else strategy

    def opening(self, problem, strategy: int) -> tuple[list[int], str]:
        """``(token ids, text)`` a rollout of arm ``strategy`` starts its response with (``([], "")``: free)."""
        if not self.guided or strategy < 0:
            return [], ""
        return self.opener.opening(problem, strategy)

    def _prompt_tokens(self, problem, strategy: int) -> int:
        """Token count of a prompt, or a lower bound past the model's positions: a very long text is first
        encoded from its head only (bounded work for a 1M-character problem), and a prompt that cannot fit is
        not kept in the cache."""
        limit = self.budget.limit

        def encode(text: str) -> list[int]:
            extra = self.conditioning(problem, strategy) if strategy >= 0 else {}
            return self._encode(self.tokenizer, text, **extra)

        head = long_head_ids(encode, self.task.format_prompt(problem), limit)
        if head is not None:
            return len(head)
        n = len(self.prompt_ids(problem, strategy))
        if limit is not None and n + self.budget.max_new_tokens > limit:
            self._prompt_cache.pop((problem.id, strategy), None)
        return n

    def _choose(self, cursor: int, n_problems: int) -> tuple[list, list[int], int]:
        """``n_problems`` problems from ``cursor`` on, skipping those too long for the model: ``(problems,
        their cursor positions, the next cursor)``."""
        chosen, positions, pos = [], [], cursor
        while len(chosen) < n_problems:
            problem = self.problems[self.problem_stream.index(pos)]
            if self._fits(problem):
                chosen.append(problem)
                positions.append(pos)
            elif len(self.budget.too_long) >= len(self.problems):
                longest = max(self.budget.too_long.values())
                raise ValueError(f"every training problem's prompt is too long for the model ({self.budget.limit} "
                                 f"positions, rollout.max_new_tokens={self.budget.max_new_tokens}; longest prompt "
                                 f"{longest} tokens)")
            pos += 1
        return chosen, positions, pos

    def _sample(self, cursor: int, n_problems: int, seed: int) -> tuple[StepData, int]:
        from meshrl.rollout import SamplingParams

        ro = self.cfg.rollout
        chosen, positions, next_cursor = self._choose(cursor, n_problems)
        arms, n = self._arms(chosen)
        params = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
                                top_p=ro.top_p, n=n)
        prompts = [self.prompt_ids(chosen[j], self._prompt_arm(k)) for j, k in arms]
        if getattr(self.task, "episodic", False):  # tool-using episodes (meshrl.trainer.episodes)
            from meshrl.trainer.episodes import sample_episodes

            def encode_with(i: int, observation: str) -> list[int]:
                j, k = arms[i]
                extra = self.conditioning(chosen[j], self._prompt_arm(k)) if self._prompt_arm(k) >= 0 else {}
                return self._encode(self.tokenizer, self.task.format_prompt(chosen[j]) + observation, **extra)

            # coach-guided: each coach arm's first model turn starts with the coach's opening
            openings = [self.opening(chosen[j], k)[0] for j, k in arms] if self.guided else None
            rows, episodes = sample_episodes(self.task, self.backend, self.tokenizer, prompts,
                                             [chosen[j] for j, _ in arms], params, seed, encode_with, openings)
            self.episodes.extend(episodes)
        elif self.guided:  # each coach arm's responses start with the opening the plug-in forces
            from meshrl.trainer.openings import generate_with_openings

            openings = [self.opening(chosen[j], k) for j, k in arms]
            rows = generate_with_openings(self.backend, prompts, openings, params, seed=seed, **self._features)
        else:
            rows = sampled_rows(self.backend.generate(prompts, params, seed=seed, **self._features))
        data = StepData()
        # One advantage group per query, unless each prefix group (the bare one included) is its own.
        per_query = self.cfg.mesh.adv_unit == "query" or self.prefixes is None
        for row in rows:
            j, k = arms[row["prompt_index"]]
            data.append(Sample(
                prompt_ids=list(row["prompt_ids"]), response_ids=list(row["response_ids"]), text=row["text"],
                truncated=bool(row["truncated"]), problem=chosen[j],
                group_id=positions[j] if per_query else (positions[j], k), query_id=positions[j], strategy_id=k,
                score=0.0,  # graded below, all rows at once
                rollout_logps=None if row["logps"] is None else list(row["logps"]),
                rollout_features=row.get("features"), origin=self.opener.name if row["forced"] else "",
                unsampled=int(row["forced"]),
                response_mask=list(row["model_mask"]) if "model_mask" in row else None,
                label_text=row["transcript"] if "model_mask" in row else None))
        owns = getattr(self.task, "owns_reward", False)  # an environment's get_reward() scores its own episodes
        self.scoring.grade(data, [row["env_reward"] for row in rows] if owns else None)
        return data, next_cursor

    def run(self, step: int, cursor: int) -> tuple[StepData, int]:
        """Sample (and, for dynamic sampling, refill) one step; return the data and the new cursor."""
        ro, rec = self.cfg.rollout, self.recipe
        t0 = time.perf_counter()
        target = ro.prompts_per_step
        rounds = self.cfg.dynamic_sampling.max_rounds if rec.dynamic_sampling else 1
        batch, sampled, kept_groups, dropped = StepData(), 0, 0, 0
        self.episodes = []
        self._features = {"features": True} if self.features_wanted(step) else {}
        sampled_reward = 0.0  # shaped reward of every sampled rollout, kept or filtered
        start, drawn = cursor, 0
        for rnd in range(rounds):
            need = target - kept_groups
            seed = self.cfg.seed * 1_000_003 + step * 97 + rnd
            data, next_cursor = self._sample(cursor, need, seed)
            cursor, drawn = next_cursor, drawn + need
            sampled += len(data)
            sampled_reward += float(self.scoring.shape_rewards(data).sum()) if len(data) else 0.0
            batch.seen.extend(zip(data.label_texts or data.texts, data.scores, data.problems, strict=True))
            if rec.dynamic_sampling:
                # DAPO filters on accuracy, not on the length-shaped reward (eq. 11).
                keep_mask = dynamic_sampling_mask(torch.tensor(data.scores), data.query_ids)
                keep = [i for i, k in enumerate(keep_mask.tolist()) if k]
                dropped += need - len({data.query_ids[i] for i in keep})
            else:
                keep = list(range(len(data)))
            batch.extend(data, keep)
            kept_groups = len(set(batch.query_ids))
            if kept_groups >= target:
                break
        batch.rewards = self.scoring.shape_rewards(batch) if len(batch) else torch.zeros(0)
        batch.advantages = (self.scoring.advantages(batch.rewards, batch.group_ids) if len(batch)
                            else torch.zeros(0))
        batch.stats = {
            "rollouts/count": float(sampled),
            "rollouts/kept": float(len(batch)),
            "rollouts/groups_dropped": float(dropped),
            "reward/sampled_mean": sampled_reward / sampled if sampled else float("nan"),
            "skipped/long_prompts": float(cursor - start - drawn),  # problems too long for the model
            "time/rollout_s": time.perf_counter() - t0,
        }
        if self.episodes:
            from meshrl.agents import episode_metrics

            batch.stats.update(episode_metrics(self.episodes))
        return batch, cursor

    def features_wanted(self, step: int) -> bool:
        """Whether step ``step`` asks the backend for the rows' MEI features: MEI's ``bias`` map is computed at
        this step (``diag.mei.every``) and the backend can return them (``returns_features``)."""
        mc = self.cfg.diag.mei
        return (mc.every > 0 and step % mc.every == 0 and mc.feature == "bias"
                and self.backend.returns_features)


def sampled_rows(out: Any) -> list[dict[str, Any]]:
    """One record per sample of a backend's :class:`~meshrl.rollout.Rollouts`, prompt-major (as the coach-guided
    sampler returns them)."""
    order = sorted(range(len(out.prompt_index)), key=lambda r: out.prompt_index[r])  # stable: sample order kept
    features = getattr(out, "engine_features", None)  # a backend's own result type may predate MEI's features
    return [{"prompt_index": out.prompt_index[r], "prompt_ids": list(out.prompt_ids[r]),
             "response_ids": list(out.response_ids[r]), "text": out.texts[r], "truncated": bool(out.truncated[r]),
             "logps": None if out.engine_logprobs is None else list(out.engine_logprobs[r]), "forced": 0,
             "features": None if features is None else features[r]}
            for r in order]
