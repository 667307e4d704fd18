"""The warm start of ``testbed:tools``: a small built-in model taught reference *episodes* of both tool patterns.

:func:`tools_warm_start` trains ``meshrl.models.build_tiny(preset)`` by teacher forcing on reference episodes of
training problems (:meth:`ToolsTestbed.reference_turns`): a calculator call, the tool's response, the answer; or
the answer at once. The pattern of each example is drawn independently of the problem type (calculator with
probability ``tool_share``), so the starting policy uses both patterns on both types and RL has to find out where
the tool is needed. The direct answer on ``mul`` is the true product, which the model cannot compute in one
pass: it learns the form (a four- or five-digit number), not the value, so its direct answers there are wrong.

Every example is token-exact with what :func:`meshrl.agents.run_episodes` assembles for the same turns
(:func:`reference_episode`): the prompt is the task's own (``ToolsTestbed.encode_prompt``), each model turn is
its text's ids plus eos, and the tool's response is the :class:`~meshrl.agents.ToolResponseRenderer`'s ids of
the real calculator's result. Tool-response tokens are masked out of the loss (label -100), as the trainer's
update masks them out of every term.

A few extra examples (``coach_fraction`` per plain one) carry a rule-coach tool plan (``COACH_PLANS``) in the
system message and follow it, so that Mesh's conditioned rollouts follow their plan.

Cached on disk as :func:`meshrl.testbed.warm.warm_start` does (same cache root, marker and atomic publish), under
a hash of every setting that changes the weights. The default (:func:`default_tools_warm_start`) is two stages:
the second continues the first at a lower learning rate (``init=``), because a fresh model learns the call format
quickly and copying digits (the operands into the call, the tool's result into the answer) only much later.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import torch

from meshrl.testbed.tools_task import COACH_PLANS, TOOL_NAME, ToolsTestbed, calculator, parse_mix, sample_problems
from meshrl.testbed.warm import MARKER, build_cached, cache_root, settings_hash, train_and_save

TOOLS_WARM_VERSION = "testbed-tools-warm-v1"  # bump when data, format or training loop change the weights
DEFAULT_TOOLS_STEPS = 700
PATTERNS = ("direct", TOOL_NAME)


def reference_episode(task: ToolsTestbed, tokenizer: Any, renderer: Any, problem: Any, pattern: str, *,
                      system: str | None = None) -> tuple[list[int], list[int], list[int]]:
    """``(prompt ids, episode ids, model mask)`` of the reference episode of ``pattern`` on ``problem``: the ids
    ``run_episodes`` appends when the model samples the reference turns (each turn's text ids, then eos), with
    the calculator's rendered response between them (mask 0)."""
    prompt = task.encode_prompt(tokenizer, task.format_prompt(problem), system=system)
    ids: list[int] = []
    mask: list[int] = []
    turns = task.reference_turns(problem, pattern)
    for index, text in enumerate(turns):
        turn = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
        ids += turn
        mask += [1] * len(turn)
        if index < len(turns) - 1:  # the call's response, as the episode renders it
            response = renderer.ids([(TOOL_NAME, calculator(problem.prompt))])
            ids += response
            mask += [0] * len(response)
    return prompt, ids, mask


def tools_warm_settings(*, seed: int, steps: int, preset: str, batch_size: int, lr: float, coach_fraction: float,
                        tool_share: float, mix: Any = None, init: dict[str, Any] | None = None,
                        coach_plans: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything that determines the weights (and names the cache directory); ``init``: the recorded settings of
    the warm start this one continues from (``None``: a fresh model)."""
    settings = {"version": TOOLS_WARM_VERSION, "task": "testbed:tools", "seed": int(seed), "steps": int(steps),
                "preset": preset, "batch_size": int(batch_size), "lr": float(lr),
                "coach_fraction": float(coach_fraction), "tool_share": float(tool_share), "mix": parse_mix(mix),
                "coach_plans": dict(coach_plans or COACH_PLANS)}
    if init is not None:
        settings["init"] = init
    return settings


def tools_warm_start(out_dir: str | os.PathLike | None = None, *, seed: int = 0, steps: int = DEFAULT_TOOLS_STEPS,
                     preset: str = "tiny:small", force: bool = False, batch_size: int = 32, lr: float = 3e-3,
                     coach_fraction: float = 0.1, tool_share: float = 0.5, mix: Any = None,
                     threads: int | None = None, progress: bool = True, init: str | os.PathLike | None = None,
                     coach_plans: dict[str, str] | None = None) -> Path:
    """Return the directory of a warm-started ``testbed:tools`` model, training it first if it is not cached.

    ``tool_share``: the probability that an example is a calculator episode (else a direct answer), on every
    type; ``coach_fraction``: coach-conditioned examples per plain one (extra). The other arguments as
    :func:`meshrl.testbed.warm.warm_start`'s (``out_dir``, ``seed``, ``steps``, ``preset``, ``force``,
    ``batch_size``, ``lr`` with its warm-up / stable / decay schedule, ``mix``, ``threads``, ``progress``).

    ``init``: a warm start directory to continue from instead of a fresh model (its settings are recorded in this
    one's, so the lineage names the cache directory); ``coach_plans``: the plan texts of the coach examples
    (default :data:`COACH_PLANS`, the texts the trainer's Mesh recipes use)."""
    if steps < 0 or batch_size < 1 or not 0 <= coach_fraction < 1 or lr <= 0 or not 0 <= tool_share <= 1:
        raise ValueError(f"bad tools warm-start settings: steps={steps}, batch_size={batch_size}, lr={lr}, "
                         f"coach_fraction={coach_fraction}, tool_share={tool_share}")
    init_settings = None
    if init is not None:
        marker = Path(init).expanduser() / MARKER
        if not marker.is_file():
            raise ValueError(f"tools warm start: init={init} is not a warm start directory (no {MARKER})")
        init_settings = {**json.loads(marker.read_text())["settings"], "path": str(Path(init).expanduser())}
    settings = tools_warm_settings(seed=seed, steps=steps, preset=preset, batch_size=batch_size, lr=lr,
                                   coach_fraction=coach_fraction, tool_share=tool_share, mix=mix, init=init_settings,
                                   coach_plans=coach_plans)
    target = Path(out_dir).expanduser() if out_dir is not None else cache_root() / f"tools_{settings_hash(settings)}"
    return build_cached(target, settings, lambda out: _train(out, settings, threads=threads, progress=progress),
                        force=force)


def _train(out: Path, settings: dict[str, Any], *, threads: int | None, progress: bool) -> dict[str, Any]:
    from meshrl.models import build_tiny, load_model

    def make_model():
        if "init" in settings:  # a continued warm start
            return load_model(settings["init"]["path"])
        return build_tiny(settings["preset"], seed=settings["seed"])

    return train_and_save(out, settings, make_model, EpisodeExamples, threads=threads, progress=progress)


class EpisodeExamples:
    """Seeded stream of teacher-forcing batches of reference episodes (plain prompts, a few coach-conditioned)."""

    def __init__(self, tok: Any, settings: dict[str, Any]) -> None:
        from meshrl.agents import ToolResponseRenderer

        self.tok, self.settings = tok, settings
        self.task = ToolsTestbed(seed=settings["seed"], size=1, eval_size=0, mix=settings["mix"])
        self.renderer = ToolResponseRenderer(tok)
        self.rng = random.Random(f"testbed-tools-warm-{settings['seed']}")
        self.per_step = settings["batch_size"] * settings["coach_fraction"]
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def rows(self, n: int, coached: bool) -> list[tuple[list[int], list[int], list[int]]]:
        """``n`` reference episodes of training problems, each ``(prompt, ids, mask)``. A coached one follows its
        plan; a plain one draws its pattern (calculator with probability ``tool_share``)."""
        out = []
        for problem in sample_problems(n, self.settings["mix"], self.rng, held_out=False):
            tool = self.rng.random() < self.settings["tool_share"]
            pattern = TOOL_NAME if tool else "direct"
            system = self.settings["coach_plans"][pattern] if coached else None
            out.append(reference_episode(self.task, self.tok, self.renderer, problem, pattern, system=system))
        return out

    def next(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Padded ``(input_ids, attention_mask, labels)`` micro-batches of step ``step``: ``batch_size`` plain
        episodes, and the coached ones of this step (``floor((step + 1) q) - floor(step q)``, ``q`` = batch size
        x coach fraction) in a second micro-batch. Labels are -100 on the prompt, the tool response and padding."""
        n_coach = math.floor((step + 1) * self.per_step + 1e-9) - math.floor(step * self.per_step + 1e-9)
        parts = [self.rows(self.settings["batch_size"], False)]
        if n_coach:
            parts.append(self.rows(n_coach, True))
        return [pad_episodes(rows, self.pad) for rows in parts]


def pad_episodes(rows: list[tuple[list[int], list[int], list[int]]], pad: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` of ``(prompt, ids, mask)`` rows, right-padded; a label is the
    token where the mask is 1 and -100 elsewhere (prompt, tool response, padding)."""
    width = max(len(p) + len(r) for p, r, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, response, mask) in enumerate(rows):
        seq = prompt + response
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        labels[i, len(prompt): len(seq)] = torch.tensor([t if m else -100 for t, m in zip(response, mask, strict=True)])
    return ids, attention, labels


#: The default warm start, in two stages: a fresh model taught the episodes (700 steps of 32 at lr 3e-3), which
#: learns the call format and only begins to copy digits (operands into the call, the tool's result into the
#: answer); then 1000 more steps of 32 at lr 1e-3 from it. The first stage's coach examples used the direct plan's
#: earlier text "Answer directly." (refused by Mesh's prefix check: fewer than 3 words); the second teaches the
#: current ``COACH_PLANS``. Both stages are recorded in the result's settings (``init``).
STAGE1 = {"steps": 700, "batch_size": 32, "lr": 3e-3, "coach_plans": {**COACH_PLANS, "direct": "Answer directly."}}
STAGE2 = {"steps": 1000, "batch_size": 32, "lr": 1e-3}


def default_tools_warm_start(*, seed: int = 0, threads: int | None = None, progress: bool = True) -> Path:
    """The two-stage default warm start (:data:`STAGE1`, :data:`STAGE2`), each stage cached."""
    first = tools_warm_start(seed=seed, threads=threads, progress=progress, **STAGE1)
    return tools_warm_start(seed=seed, threads=threads, progress=progress, init=first, **STAGE2)
