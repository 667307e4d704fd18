"""Tiny built-in tasks for tests and quick runs with very small models.

``tiny:repeat``
    ``Repeat: 7`` -> ``7`` over the symbols ``0-9a-f``.  Its reward is *dense*: the fraction of
    non-whitespace characters of the completion equal to the answer character, so even the outputs
    of a randomly initialised character-level model get graded signal (about 1/vocab on average)
    and a learning test can watch the reward rise.  Options: ``size`` (train, default 64) and
    ``eval_size`` (default 16).  Both splits are balanced over the symbols; since there are only 16
    distinct prompts the eval problems are fresh draws of the same prompts, not unseen prompts.

``tiny:add``
    Single-digit addition ``3+4=`` -> ``7`` over all pairs ``0..max_operand`` (default 9, i.e. 100
    problems), with a seeded held-out split (``eval_fraction``, default 0.2) of disjoint pairs.
    ``reward_kind`` is ``number`` but scoring takes the *first integer* in the completion instead of
    the strict final-answer extraction of ``meshrl.rewards``: tiny models continue ``3+4=`` with a
    number and never learn to write ``\\boxed{}`` or ``<answer>`` tags, so strict extraction would
    give them no signal at all.
"""

from __future__ import annotations

import random
import re
from typing import Any

from meshrl.tasks._spec import held_out_split
from meshrl.tasks.base import Problem, StaticTask, register_task, take_options

REPEAT_SYMBOLS = "0123456789abcdef"
_FIRST_INT = re.compile(r"-?\d+")

REPEAT_STRATEGIES = (
    "Copy the symbol after the colon exactly, because the task only asks for an echo.",
    "Read the last character of the prompt and write it alone, since anything else lowers the reward.",
    "Write the requested symbol several times in a row, since every matching character earns credit.",
    "Identify whether the symbol is a digit or a letter first, then reproduce that same symbol.",
)
ADD_STRATEGIES = (
    "Count on from the larger addend by the smaller one, because counting fewer steps avoids slips.",
    "Make a ten first: move units from one addend to the other to complete ten, then add the rest.",
    "Use a known double near the pair and adjust by the difference, since doubles are memorised facts.",
    "Swap the order of the addends and add again to check, because addition is commutative.",
)


def repeat_reward(completion: str, answer: str) -> float:
    """Fraction of the completion's non-whitespace characters equal to ``answer`` (empty -> 0)."""
    chars = "".join(completion.split())
    if not chars:
        return 0.0
    return sum(ch == answer for ch in chars) / len(chars)


def first_integer(completion: str) -> int | None:
    """The first (optionally negative) integer written in ``completion``, or ``None``."""
    match = _FIRST_INT.search(completion)
    return int(match.group()) if match else None


class RepeatTask(StaticTask):
    """``tiny:repeat``: echo one symbol; dense per-character reward (``reward_kind="custom"``)."""

    reward_kind = "custom"

    def __init__(self, *, seed: int = 0, size: int = 64, eval_size: int = 16) -> None:
        splits = {
            "train": _repeat_problems("train", size, random.Random(f"tiny-repeat-train-{seed}")),
            "eval": _repeat_problems("eval", eval_size, random.Random(f"tiny-repeat-eval-{seed}")),
        }
        super().__init__("tiny:repeat", splits, instruction=None)

    def score(self, completion: str, problem: Problem) -> float:
        """Dense reward: see :func:`repeat_reward`."""
        return repeat_reward(completion, problem.answer)

    def coach_strategies(self, problem: Problem) -> list[str]:
        """Rule-coach prefixes (method and why, never the symbol itself)."""
        return list(REPEAT_STRATEGIES)


def _repeat_problems(split: str, n: int, rng: random.Random) -> list[Problem]:
    if n < 0:
        raise ValueError(f"tiny:repeat: split sizes must be >= 0, got {n}")
    symbols = list((REPEAT_SYMBOLS * (n // len(REPEAT_SYMBOLS) + 1))[:n])
    rng.shuffle(symbols)
    return [
        Problem(f"repeat-{split}-{i}", f"Repeat: {s}", s, {"split": split}) for i, s in enumerate(symbols)
    ]


class AddTask(StaticTask):
    """``tiny:add``: ``a+b=`` with ``a, b`` single digits; first-integer exact-match reward."""

    reward_kind = "number"

    def __init__(self, *, seed: int = 0, max_operand: int = 9, eval_fraction: float = 0.2) -> None:
        if not 1 <= max_operand <= 99:
            raise ValueError(f"tiny:add: max_operand must be in [1, 99], got {max_operand}")
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        problems = [Problem(f"add-{a}-{b}", f"{a}+{b}=", str(a + b), {"a": a, "b": b}) for a, b in pairs]
        train, held = held_out_split(problems, eval_fraction, seed)
        super().__init__("tiny:add", {"train": train, "eval": held}, instruction=None)

    def score(self, completion: str, problem: Problem) -> float:
        """1.0 when the first integer in ``completion`` equals the answer, else 0.0."""
        value = first_integer(completion)
        return float(value is not None and value == int(problem.answer))

    def coach_strategies(self, problem: Problem) -> list[str]:
        """Rule-coach prefixes: four classic single-digit addition methods (no numbers of this problem)."""
        return list(ADD_STRATEGIES)


@register_task("tiny:repeat")
def _tiny_repeat(*, seed: int = 0, **options: Any) -> RepeatTask:
    opts = take_options("tiny:repeat", options, {"size": 64, "eval_size": 16})
    return RepeatTask(seed=seed, **opts)


@register_task("tiny:add")
def _tiny_add(*, seed: int = 0, **options: Any) -> AddTask:
    opts = take_options("tiny:add", options, {"max_operand": 9, "eval_fraction": 0.2})
    return AddTask(seed=seed, **opts)
