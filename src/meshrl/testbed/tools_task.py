"""``testbed:tools``: the collapse of tool use, with ground truth. Strategies are tool patterns.

Every problem is one arithmetic expression, answered in a tool-using episode (:class:`meshrl.agents.EnvTask`)
that offers an exact calculator (:func:`calculator`). Problem types (``meta["type"]``):

``add``  ``a+b``, ``a`` three digits, ``b`` one digit (``457+8``). The tiny model adds these in its head: a
         direct answer is as good as a calculator call and 70 characters shorter.   -> home ``direct``
``mul``  ``a*b``, ``a`` three digits, ``b`` two digits (``457*38``). No procedure is written out (the direct
         answer is the bare product), so the tiny model cannot compute it: only the tool solves it.
         The niche, a minority share (``mix`` default 0.75 / 0.25).                    -> home ``calculator``

An episode is at most two model turns: a call, then the answer after the tool's result; or the answer at once.
The **reward** is strict: 1 when the final model turn is exactly the answer's digits, else 0 (no partial
credit, no whitespace). :meth:`ToolsTestbed.label_strategy` (``EnvTask``'s) labels an episode ``direct`` or
``calculator`` from its model turns; ``HOME`` is the ground truth, which type needs the tool.

**Compact prompt.** The tiny model reads characters; the tools block that ``encode_agent_prompt`` writes for a
template without tool support (Hermes' instructions plus the JSON schema) is about 600 characters, 10 times the
problem, and every character is a position of every forward pass. ``testbed:tools`` shows the tool in one line
instead, :data:`TOOLS_LINE`, as the system message (after a coach prefix when there is one), and its calculator
(:func:`calculator`: meshrl's exact calculator under a one-letter argument name) is called with compact JSON in
the episodes' strict Hermes format (:func:`call_text`, 68 characters at most). The warm start teaches the call
format, which is what a schema would tell a larger model.

Train and eval pairs are disjoint, fixed by a hash of ``(type, a, b)`` independent of the seed (as ``testbed:add``).
Build: ``load_task("testbed:tools")`` (after ``import meshrl.testbed``) or ``meshrl train --task testbed:tools``.
"""

from __future__ import annotations

import hashlib
import json
import random
from functools import lru_cache
from typing import Any

from meshrl.agents import EnvTask
from meshrl.tasks import Problem, StaticTask, register_task

TYPES: tuple[str, ...] = ("add", "mul")
HOME: dict[str, str] = {"add": "direct", "mul": "calculator"}
NICHE = "mul"
DEFAULT_MIX: dict[str, float] = {"add": 0.75, "mul": 0.25}
OPERANDS: dict[str, tuple[range, range, str]] = {  # type -> (a range, b range, operator)
    "add": (range(100, 1000), range(1, 10), "+"),
    "mul": (range(100, 1000), range(10, 100), "*"),
}
EVAL_SHARE = 8  # one pair in EVAL_SHARE is reserved for the eval split
TOOL_NAME = "calculator"
TOOLS_LINE = "tools: calculator(x)"
#: the rule coach's tool plans (Mesh): short, because every conditioned rollout reads one
COACH_PLANS: dict[str, str] = {"calculator": "Call the calculator tool first.",
                               "direct": "Answer directly, without tools."}  # >= 3 words: Mesh's prefix check
OPEN_CALL = "<tool_call>"
MAX_TURN_TOKENS = 72  # rollout.max_new_tokens: the longest call (68 characters) plus eos, with room
MAX_TOTAL_TOKENS = 120  # call + tool response (about 30 tokens) + answer, with room


def calculator(x: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        x: The expression, e.g. "123*45".
    """
    from meshrl.agents import calculator as exact_calculator

    return exact_calculator(x)


def call_text(expression: str) -> str:
    """The model turn that calls the calculator on ``expression``: compact JSON in a ``<tool_call>`` block."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"x": expression}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def expression(kind: str, a: int, b: int) -> str:
    return f"{a}{OPERANDS[kind][2]}{b}"


def answer_of(kind: str, a: int, b: int) -> int:
    return a + b if kind == "add" else a * b


def is_eval_pair(kind: str, a: int, b: int) -> bool:
    """Whether the pair belongs to the reserved eval pairs (a fixed hash, independent of any seed)."""
    digest = hashlib.blake2b(f"testbed-tools:{kind}:{a}:{b}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % EVAL_SHARE == 0


@lru_cache(maxsize=4)
def pair_pool(held_out: bool) -> dict[str, tuple[tuple[int, int], ...]]:
    """All pairs of each type in the train (``held_out=False``) or eval (``True``) pool, sorted."""
    return {kind: tuple((a, b) for a in a_range for b in b_range if is_eval_pair(kind, a, b) == held_out)
            for kind, (a_range, b_range, _) in OPERANDS.items()}


def make_problem(kind: str, a: int, b: int) -> Problem:
    """The problem with its type, operands and home pattern (the ground truth) in ``meta``."""
    if kind not in OPERANDS:
        raise ValueError(f"testbed:tools: unknown problem type {kind!r}; known: {', '.join(TYPES)}")
    a_range, b_range, _ = OPERANDS[kind]
    if a not in a_range or b not in b_range:
        raise ValueError(f"testbed:tools: {kind} operands must be in {a_range} and {b_range}, got {a}, {b}")
    meta = {"type": kind, "a": a, "b": b, "home": HOME[kind], "needs_tool": HOME[kind] == TOOL_NAME}
    return Problem(f"tools-{kind}-{a}-{b}", expression(kind, a, b), str(answer_of(kind, a, b)), meta)


def parse_mix(mix: Any) -> dict[str, float]:
    """Type weights from a dict, a list (add, mul) or ``"add:0.75,mul:0.25"``, normalised."""
    if mix is None:
        return dict(DEFAULT_MIX)
    if isinstance(mix, str):
        try:
            mix = {k.strip(): float(v) for k, v in (part.split(":", 1) for part in mix.split(",") if part.strip())}
        except ValueError:
            raise ValueError(f"testbed:tools: mix must look like 'add:0.75,mul:0.25', got {mix!r}") from None
    if isinstance(mix, list | tuple):
        if len(mix) != len(TYPES):
            raise ValueError(f"testbed:tools: mix needs {len(TYPES)} weights ({', '.join(TYPES)}), got {mix}")
        mix = dict(zip(TYPES, mix, strict=True))
    unknown = sorted(set(mix) - set(TYPES))
    if unknown:
        raise ValueError(f"testbed:tools: unknown problem type(s) {unknown} in mix; known: {', '.join(TYPES)}")
    weights = {t: float(mix.get(t, 0.0)) for t in TYPES}
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"testbed:tools: mix weights must be >= 0 with a positive sum, got {weights}")
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


def sample_problems(n: int, mix: dict[str, float], rng: random.Random, *, held_out: bool) -> list[Problem]:
    """``n`` distinct problems, types in proportion to ``mix`` (largest remainders), shuffled."""
    raw = {t: n * mix[t] for t in TYPES}
    counts = {t: int(raw[t]) for t in TYPES}
    for t in sorted(TYPES, key=lambda t: raw[t] - counts[t], reverse=True)[: n - sum(counts.values())]:
        counts[t] += 1
    pool = pair_pool(held_out)
    chosen: list[tuple[str, int, int]] = []
    for kind, count in counts.items():
        if count > len(pool[kind]):
            raise ValueError(f"testbed:tools: asked for {count} {kind!r} problems, only {len(pool[kind])} exist")
        chosen.extend((kind, a, b) for a, b in rng.sample(pool[kind], count))
    rng.shuffle(chosen)
    return [make_problem(kind, a, b) for kind, a, b in chosen]


class ToolsProblems(StaticTask):
    """The problems and the strict grade of ``testbed:tools`` (the data under the episodes)."""

    reward_kind = "custom"

    def __init__(self, *, seed: int, size: int, eval_size: int, mix: Any) -> None:
        if size < 1 or eval_size < 0:
            raise ValueError(f"testbed:tools: need size >= 1 and eval_size >= 0, got {size}, {eval_size}")
        self.mix = parse_mix(mix)
        splits = {
            "train": sample_problems(size, self.mix, random.Random(f"testbed-tools-train-{seed}"), held_out=False),
            "eval": sample_problems(eval_size, self.mix, random.Random(f"testbed-tools-eval-{seed}"), held_out=True),
        }
        super().__init__("testbed:tools", splits, instruction=None)

    def score(self, completion: str, problem: Problem) -> float:
        """1.0 when the final model turn is exactly the answer, else 0.0 (strict: no spaces, no text)."""
        return 1.0 if completion == problem.answer else 0.0

    def coach_strategies(self, problem: Problem | None = None) -> list[str] | None:
        return None  # the tool plans are the episodic task's (ToolsTestbed.coach_strategies)


class ToolsTestbed(EnvTask):
    """``testbed:tools``: :class:`ToolsProblems` in episodes with the calculator (module docstring)."""

    types = TYPES
    niche_types: tuple[str, ...] = (NICHE,)
    headline_niche = NICHE
    home = HOME

    def __init__(self, *, seed: int = 0, size: int = 2000, eval_size: int = 512, mix: Any = None,
                 max_turns: int = 2) -> None:
        from meshrl.agents import EpisodeLimits

        if max_turns < 1:
            raise ValueError(f"testbed:tools: max_turns must be >= 1, got {max_turns}")
        data = ToolsProblems(seed=seed, size=size, eval_size=eval_size, mix=mix)
        limits = EpisodeLimits(max_turns=max_turns, max_tool_calls=max_turns, max_total_tokens=MAX_TOTAL_TOKENS,
                               tool_timeout_s=5.0, max_tool_output_chars=64)
        super().__init__("testbed:tools", data, None, [calculator], limits)
        self.mix = data.mix

    @property
    def max_new_tokens(self) -> int:
        """``rollout.max_new_tokens``: the tokens of one model turn."""
        return MAX_TURN_TOKENS

    def coach_strategies(self, problem: Problem | None = None) -> list[str]:
        """The rule coach's tool plans, the same for every problem: call the calculator first; answer directly."""
        return [COACH_PLANS["calculator"], COACH_PLANS["direct"]]

    def response_opening(self, problem: Problem, prefix: str) -> str:
        """What a coach-guided episode (``plugins.coach_guide``) forces at the start of its first model turn: the
        calculator plan opens a tool call (``<tool_call>``, the rest of the call is the model's); the direct plan
        has nothing to force (``""``: those rollouts are free)."""
        if prefix == COACH_PLANS["calculator"]:
            return OPEN_CALL
        if prefix == COACH_PLANS["direct"]:
            return ""
        raise ValueError(f"testbed:tools: {prefix!r} is not one of the coach's tool plans {list(COACH_PLANS.values())}")

    def encode_prompt(self, tokenizer: Any, text: str, *, system: str | None = None,
                      assistant_prefix: str | None = None) -> list[int]:
        """The compact prompt: :data:`TOOLS_LINE` as the system message, after a coach prefix when given."""
        from meshrl.models.prompts import encode_prompt

        shown = TOOLS_LINE if system is None else f"{system}\n{TOOLS_LINE}"
        return encode_prompt(tokenizer, text, system=shown, assistant_prefix=assistant_prefix)

    def reference_turns(self, problem: Problem, pattern: str) -> list[str]:
        """The model turns of the reference episode of ``pattern``: ``["<tool_call>...", answer]`` for the
        calculator, ``[answer]`` for a direct answer (the answer is always the true one: the warm start teaches
        the bare product on ``mul``, which the model cannot compute, so its direct answers there are mostly wrong)."""
        if pattern == "direct":
            return [problem.answer]
        if pattern == TOOL_NAME:
            return [call_text(problem.prompt), problem.answer]
        raise ValueError(f"testbed:tools: unknown tool pattern {pattern!r}; known: direct, {TOOL_NAME}")


@register_task("testbed:tools")
def _testbed_tools(*, seed: int = 0, **options: Any) -> ToolsTestbed:
    from meshrl.tasks.base import take_options

    opts = take_options("testbed:tools", options, {"size": 2000, "eval_size": 512, "mix": None, "max_turns": 2})
    return ToolsTestbed(seed=seed, **opts)
