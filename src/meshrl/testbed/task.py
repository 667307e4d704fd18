"""``testbed:add``: three-digit plus two-digit addition with three procedures and built-in niches.

Problem types (``meta["type"]``), by where the carries fall (``a`` = 3 digits, ``b`` = 2 digits):

``low``     no carry out of the tens column. Column addition stops after two columns and always fits
            the budget; round-and-adjust fits when ``b`` does not end in 0 (easy with a ones carry, a
            borrow without one); tens-then-ones fits when ``b`` ends in 0.  -> home of ``c``
``carry``   a carry out of the ones *and* out of the tens column (``573+48``). Only round-and-adjust
            fits the budget, and its take-back never borrows.                 -> home of ``r``
``decade``  ``b`` is a whole number of tens and the tens column carries (``573+40``). Only
            tens-then-ones fits: one jump.                                     -> home of ``t``

Pairs with a tens carry but no ones carry and ``b`` not ending in 0 are left out (only ``r`` fits and
it must borrow: a type nobody is good at adds noise and no niche).

The **budget** (default 21 characters, the whole response) is part of the task: a response longer than
that scores 0, like a generation cut at ``max_new_tokens``. Set the trainer's
``rollout.max_new_tokens`` to ``budget + 1`` (the extra token is the end-of-sequence token); a larger
value only wastes compute, a smaller one changes the task. ``docs/testbed_design.md`` explains the design.

**Reward** (option ``reward``): ``trace`` (default) pays 1 for the exact answer written at the end of a
complete trace of one of the procedures on the problem's operands (intermediate results unchecked);
``answer`` pays 1 for the exact answer after ``|`` whatever precedes it. Both are strict (no partial
credit) and both enforce the budget. Under ``answer``, RL shortens procedures (a column trace without its
last column fits ``carry`` problems) and wears tags off, which erodes the niches and the labels.

Train and eval problems come from disjoint pair sets fixed by a hash of ``(a, b)`` and independent of
the seed, so a warm start made with any seed never saw any seed's eval problems.
"""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache
from typing import Any

from meshrl.tasks import Problem, StaticTask, register_task
from meshrl.testbed.traces import STRATEGIES, label_strategy, reference_trace, strict_reward, trace_reward

TYPES: tuple[str, ...] = ("low", "carry", "decade")
HOME: dict[str, str] = {"low": "c", "carry": "r", "decade": "t"}
DEFAULT_MIX: dict[str, float] = {"low": 0.5, "carry": 0.25, "decade": 0.25}
DEFAULT_BUDGET = 21
REWARDS = ("trace", "answer")
A_RANGE = range(100, 900)  # sums stay below 1000: every answer has three digits
B_RANGE = range(10, 100)
EVAL_SHARE = 8  # one pair in EVAL_SHARE is reserved for the eval split

# The rule coach's prefixes: method and why, never a number (meshrl's validation rejects leaks).
COACH_TEXT: dict[str, str] = {  # short on purpose: Mesh conditions every rollout on one (prompt length)
    "c": "Column by column from the ones, carrying a ten.",
    "t": "Add the tens of the second number, then its ones.",
    "r": "Round the second number up to tens, then take back.",
}
#: Three distinct phrasings per procedure (the first is ``COACH_TEXT``): an applicable-strategy coach
#: that has fewer fitting procedures than ``mesh.m`` repeats one, and meshrl's prefix validation rejects
#: identical or near-identical prefixes of one problem (token Jaccard >= 0.7), so repeats are rephrased.
COACH_VARIANTS: dict[str, tuple[str, ...]] = {
    "c": (COACH_TEXT["c"], "Write each column sum, ones first, and carry.", "Work digit by digit with carries."),
    "t": (COACH_TEXT["t"], "Jump by the tens first, then add the ones.", "First the tens jump, ones after."),
    "r": (COACH_TEXT["r"], "Use the next whole ten and subtract the excess.", "Overshoot to a ten, then adjust."),
}
COACHES = ("all", "applicable")


def prefix_strategy(prefix: str) -> str | None:
    """The procedure a coach prefix (any of ``COACH_VARIANTS``) describes, or ``None``."""
    for name, texts in COACH_VARIANTS.items():
        if prefix.strip() in texts:
            return name
    return None


def applicable_prefixes(feasible: set[str], m: int = 3) -> list[str]:
    """The applicable-strategy coach: ``m`` prefixes describing only procedures in ``feasible`` (those that
    can solve the problem), cycling over them in ``STRATEGIES`` order; the j-th repeat of a procedure uses
    its j-th phrasing. ``{"r"}`` -> the three phrasings of ``r``; ``{"c", "r"}`` -> c, r, c (second phrasing)."""
    names = [s for s in STRATEGIES if s in feasible]
    if not names:
        raise ValueError("applicable coach: no procedure can solve this problem")
    if m > len(names) * len(COACH_VARIANTS[names[0]]):
        raise ValueError(f"applicable coach: {m} prefixes need more phrasings than {len(names)} procedure(s) have")
    return [COACH_VARIANTS[names[i % len(names)]][i // len(names)] for i in range(m)]


def problem_type(a: int, b: int) -> str | None:
    """``low``, ``carry``, ``decade`` or ``None`` (left out) for the pair ``a+b``."""
    ones = a % 10 + b % 10 >= 10
    tens = (a // 10) % 10 + (b // 10) % 10 + int(ones) >= 10
    if not tens:
        return "low"
    if b % 10 == 0:
        return "decade"
    return "carry" if ones else None


def is_eval_pair(a: int, b: int) -> bool:
    """Whether ``(a, b)`` belongs to the reserved eval pairs (a fixed hash, independent of any seed)."""
    digest = hashlib.blake2b(f"testbed-add:{a}+{b}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % EVAL_SHARE == 0


@lru_cache(maxsize=4)
def pair_pool(held_out: bool) -> dict[str, tuple[tuple[int, int], ...]]:
    """All pairs of each type in the train (``held_out=False``) or eval (``True``) pool, sorted."""
    pools: dict[str, list[tuple[int, int]]] = {t: [] for t in TYPES}
    for a in A_RANGE:
        for b in B_RANGE:
            kind = problem_type(a, b)
            if kind is not None and is_eval_pair(a, b) == held_out:
                pools[kind].append((a, b))
    return {t: tuple(v) for t, v in pools.items()}


def feasible_strategies(a: int, b: int, budget: int = DEFAULT_BUDGET) -> set[str]:
    """Procedures whose correct, complete trace fits ``budget`` characters for ``a+b``."""
    return {s for s in STRATEGIES if len(reference_trace(a, b, s)) <= budget}


def make_problem(a: int, b: int) -> Problem:
    """The problem ``a+b`` with its type, home procedure and operands in ``meta``."""
    kind = problem_type(a, b)
    if kind is None:
        raise ValueError(f"{a}+{b} has no testbed type (tens carry without a ones carry)")
    meta = {"a": a, "b": b, "type": kind, "home": HOME[kind]}
    return Problem(f"add-{a}-{b}", f"{a}+{b}", str(a + b), meta)


def parse_mix(mix: Any) -> dict[str, float]:
    """Type weights from a dict, a list of three numbers (low, carry, decade) or ``"low:0.5,carry:..."``."""
    if mix is None:
        return dict(DEFAULT_MIX)
    if isinstance(mix, str):
        items = [part.split(":", 1) for part in mix.split(",") if part.strip()]
        mix = {k.strip(): float(v) for k, v in items}
    if isinstance(mix, list | tuple):
        if len(mix) != len(TYPES):
            raise ValueError(f"testbed:add: mix needs {len(TYPES)} weights ({', '.join(TYPES)}), got {mix}")
        mix = dict(zip(TYPES, mix, strict=True))
    unknown = sorted(set(mix) - set(TYPES))
    if unknown:
        raise ValueError(f"testbed:add: unknown problem type(s) {unknown} in mix; known: {', '.join(TYPES)}")
    weights = {t: float(mix.get(t, 0.0)) for t in TYPES}
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"testbed:add: mix weights must be >= 0 with a positive sum, got {weights}")
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


def type_counts(n: int, mix: dict[str, float]) -> dict[str, int]:
    """Split ``n`` problems over the types in proportion to ``mix`` (largest remainders)."""
    raw = {t: n * mix[t] for t in TYPES}
    counts = {t: int(raw[t]) for t in TYPES}
    for t in sorted(TYPES, key=lambda t: raw[t] - counts[t], reverse=True)[: n - sum(counts.values())]:
        counts[t] += 1
    return counts


def sample_problems(n: int, mix: dict[str, float], rng: random.Random, *, held_out: bool) -> list[Problem]:
    """``n`` distinct problems, types in proportion to ``mix``, in a shuffled order."""
    pool = pair_pool(held_out)
    pairs: list[tuple[int, int]] = []
    for kind, count in type_counts(n, mix).items():
        if count > len(pool[kind]):
            raise ValueError(f"testbed:add: asked for {count} {kind!r} problems, only {len(pool[kind])} exist")
        pairs.extend(rng.sample(pool[kind], count))
    rng.shuffle(pairs)
    return [make_problem(a, b) for a, b in pairs]


class AddTestbed(StaticTask):
    """``testbed:add``: strict reward with a length budget, a strategy parser and the rule coach."""

    reward_kind = "custom"
    strategies = STRATEGIES
    types = TYPES

    niche_types: tuple[str, ...] = ("carry", "decade")  # types a single-procedure collapse loses
    headline_niche = "decade"  # the niche of the rare specialist; "kept" = accuracy >= 0.5 on it

    def __init__(self, *, seed: int = 0, size: int = 2000, eval_size: int = 512, mix: Any = None,
                 budget: int = DEFAULT_BUDGET, reward: str = "trace", coach: str = "all",
                 follow: bool = False) -> None:
        if size < 1 or eval_size < 0:
            raise ValueError(f"testbed:add: need size >= 1 and eval_size >= 0, got {size}, {eval_size}")
        if budget < 4:
            raise ValueError(f"testbed:add: budget must be >= 4 characters, got {budget}")
        if reward not in REWARDS:
            raise ValueError(f"testbed:add: reward must be one of {REWARDS}, got {reward!r}")
        if coach not in COACHES:
            raise ValueError(f"testbed:add: coach must be one of {COACHES}, got {coach!r}")
        if not isinstance(follow, bool):  # bool("false") is True: accept real booleans only
            raise ValueError(f"testbed:add: follow must be true or false, got {follow!r}")
        self.reward, self.coach, self.follow = reward, coach, follow
        self.mix = parse_mix(mix)
        self.budget = int(budget)
        splits = {
            "train": sample_problems(size, self.mix, random.Random(f"testbed-add-train-{seed}"), held_out=False),
            "eval": sample_problems(eval_size, self.mix, random.Random(f"testbed-add-eval-{seed}"), held_out=True),
        }
        super().__init__("testbed:add", splits, instruction=None)

    @property
    def max_new_tokens(self) -> int:
        """The ``rollout.max_new_tokens`` that matches the budget (one more, for the eos token)."""
        return self.budget + 1

    def score(self, completion: str, problem: Problem) -> float:
        """Strict, budget included: :func:`~meshrl.testbed.traces.trace_reward` (``reward="trace"``, the
        default) or :func:`~meshrl.testbed.traces.strict_reward` (``reward="answer"``)."""
        if self.reward == "answer":
            return strict_reward(completion, problem.answer, self.budget)
        return trace_reward(completion, problem.meta["a"], problem.meta["b"], self.budget)

    def label_strategy(self, completion: str, *, partial: bool = True, loose: bool = True) -> str | None:
        """The procedure ``completion`` used (see :func:`meshrl.testbed.traces.label_strategy`).

        The task's defaults are the lenient labelling that strategy masses need (the trainer calls it with
        the defaults): a trace cut off by the budget counts as the procedure it was writing, and the working
        decides, not the tag, since RL can wear tags off. With the strict parser defaults about a third of
        early-RL rollouts went unlabelled and the masses described only the survivors.
        """
        return label_strategy(completion, partial=partial, loose=loose)

    def reference_trace(self, problem: Problem, strategy: str) -> str:
        """The correct, complete trace of ``strategy`` for ``problem``."""
        return reference_trace(problem.meta["a"], problem.meta["b"], strategy)

    def feasible(self, problem: Problem) -> set[str]:
        """Procedures whose reference trace fits this task's budget on ``problem``."""
        return feasible_strategies(problem.meta["a"], problem.meta["b"], self.budget)

    def forced_prompt(self, problem: Problem, strategy: str) -> ForcedPrompt:
        """The prompt that forces ``strategy`` (see :func:`forced_prompt`)."""
        return forced_prompt(problem, strategy)

    def response_opening(self, problem: Problem, prefix: str) -> str:
        """What a coach-guided response (``plugins.coach_guide``) starts with: the tag of the procedure coach
        ``prefix`` describes, as :func:`forced_prompt` forces it (``"t:"``)."""
        strategy = prefix_strategy(prefix)
        if strategy is None:
            raise ValueError(f"coach prefix {prefix!r} describes none of the testbed's procedures")
        return f"{strategy}:"

    def coach_strategies(self, problem: Problem) -> list[str]:
        """Rule-coach prefixes (no numbers of the problem): ``coach="all"`` (default) one per procedure in
        ``STRATEGIES`` order for every problem; ``coach="applicable"`` only procedures that fit this
        problem's budget (:func:`applicable_prefixes`), what a strong coach that can solve it would say."""
        if self.coach == "applicable":
            return applicable_prefixes(self.feasible(problem), len(STRATEGIES))
        return coach_strategies(problem)

    def conditioned_score(self, score: float, completion: str, problem: Problem, prefix: str) -> float:
        """Score of a rollout sampled under coach ``prefix`` (the trainer calls this for Mesh rollouts).

        With ``follow=True`` (the coach-following reward) a rollout that does not use the procedure its
        prefix describes earns 0: strict parser label (tag and well-formed trace) against
        :func:`prefix_strategy`. Otherwise the score is unchanged. Unconditioned rollouts are never touched.
        """
        if not self.follow or score <= 0:
            return score
        return score if label_strategy(completion) == prefix_strategy(prefix) else 0.0


class ForcedPrompt:
    """A prompt whose answer is forced to start with a strategy tag (the tag is part of the response)."""

    def __init__(self, user: str, assistant_prefix: str) -> None:
        self.user, self.assistant_prefix = user, assistant_prefix

    def ids(self, tokenizer) -> list[int]:
        """Token ids: the chat prompt, then the tag (see :func:`meshrl.models.encode_prompt`)."""
        from meshrl.models import encode_prompt

        return encode_prompt(tokenizer, self.user, assistant_prefix=self.assistant_prefix)

    def __repr__(self) -> str:
        return f"ForcedPrompt(user={self.user!r}, assistant_prefix={self.assistant_prefix!r})"


def forced_prompt(problem: Problem, strategy: str) -> ForcedPrompt:
    """The prompt that forces ``strategy``: the problem as the user turn, the tag starting the answer.

    The tag (``"c:"``) is part of the response: score and label ``tag + generated text``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    return ForcedPrompt(user=problem.prompt, assistant_prefix=f"{strategy}:")


def coach_strategies(problem: Problem | None = None) -> list[str]:
    """The rule coach's prefixes, one per procedure in ``STRATEGIES`` order (the same for every problem)."""
    return [COACH_TEXT[s] for s in STRATEGIES]


@register_task("testbed:add")
def _testbed_add(*, seed: int = 0, **options: Any) -> AddTestbed:
    from meshrl.tasks.base import take_options

    opts = take_options("testbed:add", options,
                        {"size": 2000, "eval_size": 512, "mix": None, "budget": DEFAULT_BUDGET, "reward": "trace",
                         "coach": "all", "follow": False})
    return AddTestbed(seed=seed, **opts)
