"""The three written procedures of the testbed, their reference traces, the parser and the reward.

A problem is ``a+b`` with ``a`` of three digits and ``b`` of two. A response is a *trace*: a one-letter
strategy tag, a colon, the working, a bar and the answer. The three procedures (``docs/testbed_design.md``):

``c`` column
    Column by column from the ones place, carrying a one; once the second number has no digits left
    and nothing is carried, the remaining digits are simply brought down:
    ``573+48`` -> ``c:3+8=11;7+4+1=12;5+0+1=6|621``, ``523+41`` -> ``c:3+1=4;2+4=6|564``.
``t`` tens, then ones ("jump")
    Keep the first number whole, add the tens of the second, then its ones (skipped when zero):
    ``573+48`` -> ``t:573+40=613;613+8=621|621``, ``573+40`` -> ``t:573+40=613|613``.
``r`` round and adjust
    Round the second number up to the next whole ten R = b + d, add R, take d back in the answer:
    ``573+48`` -> ``r:573+50-2=623-2|621``, ``573+40`` -> ``r:573+50-10=623-10|613``.

Everything here is a pure function of strings and integers (no torch), so tests and the trainer's
reward path stay cheap.
"""

from __future__ import annotations

import regex

STRATEGIES: tuple[str, ...] = ("c", "t", "r")
STRATEGY_NAMES: dict[str, str] = {"c": "column", "t": "tens-then-ones", "r": "round-and-adjust"}

_D = r"(?:0|[1-9]\d*)"  # a non-negative integer without leading zeros
_COL = r"\d\+\d(?:\+1)?=(?:1\d|\d)"
# Well-formed traces. Arithmetic is *not* checked: a trace with a wrong sum is still an attempt at
# that procedure (its reward is 0), and the label is about which procedure was attempted.
GRAMMARS: dict[str, regex.Pattern] = {
    "c": regex.compile(rf"c:{_COL}(?:;{_COL})*\|{_D}"),
    "t": regex.compile(rf"t:{_D}\+[1-9]\d*0={_D}(?:;{_D}\+[1-9]={_D})?\|{_D}"),
    "r": regex.compile(rf"r:{_D}\+[1-9]\d*0-(?P<d>[1-9]|10)={_D}-(?P=d)\|{_D}"),
}


def _digits(n: int) -> list[int]:
    """Decimal digits of ``n >= 0``, ones first."""
    return [int(ch) for ch in reversed(str(n))]


def trace_c(a: int, b: int) -> str:
    """Column addition, ones first; stops when ``b`` has no digits left and nothing is carried."""
    da, db = _digits(a), _digits(b)
    steps, carry, i = [], 0, 0
    while i < len(db) or carry:
        x = da[i] if i < len(da) else 0
        y = db[i] if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+1={s}" if carry else f"{x}+{y}={s}")
        carry, i = int(s >= 10), i + 1
    return "c:" + ";".join(steps) + f"|{a + b}"


def trace_t(a: int, b: int) -> str:
    """Tens then ones: ``a + tens(b)``, then ``+ ones(b)`` when the ones digit is not zero."""
    if b < 10:
        raise ValueError(f"tens-then-ones needs b >= 10, got {b}")
    tens, ones = b - b % 10, b % 10
    steps = [f"{a}+{tens}={a + tens}"]
    if ones:
        steps.append(f"{a + tens}+{ones}={a + b}")
    return "t:" + ";".join(steps) + f"|{a + b}"


def trace_r(a: int, b: int) -> str:
    """Round ``b`` up to the next whole ten ``R`` (strictly above b), add it, take ``d = R - b`` back."""
    if b < 1:
        raise ValueError(f"round-and-adjust needs b >= 1, got {b}")
    big = (b // 10 + 1) * 10
    d = big - b
    return f"r:{a}+{big}-{d}={a + big}-{d}|{a + b}"


TRACERS = {"c": trace_c, "t": trace_t, "r": trace_r}


def reference_trace(a: int, b: int, strategy: str) -> str:
    """The correct, complete trace of ``strategy`` (``c``, ``t`` or ``r``) for ``a+b``."""
    if strategy not in TRACERS:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    return TRACERS[strategy](a, b)


# The working of each procedure without its tag, for ``loose`` labelling.
BODIES: dict[str, regex.Pattern] = {k: regex.compile(g.pattern[2:]) for k, g in GRAMMARS.items()}
_LOOSE_TAG = regex.compile(r"[a-z]?:")


def label_strategy(completion: str, *, partial: bool = False, loose: bool = False) -> str | None:
    """The procedure a response follows: ``"c"``, ``"t"``, ``"r"``, or ``None``.

    Strict (default): the tag *and* a well-formed trace of that procedure (``GRAMMARS``: the shape of
    every step, the answer after ``|``; for ``r`` the same adjustment on both sides). Arithmetic is not
    checked.

    ``partial=True``: a response that is a proper beginning of a well-formed trace (at least one
    character past the tag) also gets its label; that is how a trace cut off by the length budget still
    counts as the procedure it was attempting.

    ``loose=True``: the label comes from the shape of the working alone (``BODIES``), whatever tag (or
    bare ``:``) precedes it. RL can wear the tag off while keeping the procedure (a run at lr 3e-4 wrote
    ``:5442+50=592|592``, tens-then-ones with a lost tag and a doubled digit, on most ``decade`` problems);
    strict labels call that ``None``, loose ones ``t``. The three bodies are disjoint, so the label is
    unique; a cut-off body that more than one procedure could still complete gets ``None``.
    """
    if len(completion) >= 2 and completion[1] == ":" and completion[0] in GRAMMARS:
        grammar = GRAMMARS[completion[0]]
        if grammar.fullmatch(completion):
            return completion[0]
        if partial and len(completion) > 2 and grammar.fullmatch(completion, partial=True):
            return completion[0]
    if not loose:
        return None
    head = _LOOSE_TAG.match(completion)
    body = completion[head.end():] if head else completion
    if not body:
        return None
    for name, pattern in BODIES.items():
        if pattern.fullmatch(body):
            return name
    if partial:  # a cut-off working counts only when a single procedure can still complete it
        hits = [name for name, pattern in BODIES.items() if pattern.fullmatch(body, partial=True)]
        return hits[0] if len(hits) == 1 else None
    return None


def final_answer(completion: str) -> str | None:
    """The text after the first ``|`` (``None`` when there is no bar)."""
    if "|" not in completion:
        return None
    return completion.split("|", 1)[1]


_RESULT = regex.compile(r"=\d+")
_T_CARRIED = regex.compile(r";\d+\+")


def skeleton(trace: str) -> str:
    """``trace`` with every written result replaced by ``#``: what is left is the procedure's shape on its
    operands (tag, operands, carries, number of steps) and the final answer.

    ``c:3+8=11;7+4+1=12;5+0+1=6|621`` -> ``c:3+8=#;7+4+1=#;5+0+1=#|621``; in a tens-then-ones trace the
    second step starts from the first step's result, which is masked too: ``t:573+40=#;#+8=#|621``.
    """
    out = _RESULT.sub("=#", trace)
    return _T_CARRIED.sub(";#+", out) if out.startswith("t:") else out


def strict_reward(completion: str, answer: str, budget: int) -> float:
    """Answer-only reward: 1.0 iff the response fits the budget and everything after its first ``|`` is
    exactly ``answer``.

    No partial credit, no stripping of whitespace, no tolerance for leading zeros or trailing text:
    ``...|621`` scores for 621, ``...|621 ``, ``...|0621`` and ``...|621|621`` do not. A response longer
    than ``budget`` characters scores 0 whatever it says (it did not finish within the budget).
    """
    if len(completion) > budget:
        return 0.0
    return float(final_answer(completion) == answer)


def trace_reward(completion: str, a: int, b: int, budget: int) -> float:
    """Trace reward: :func:`strict_reward` *and* the response is a complete trace of one of the three
    procedures on this problem's operands.

    The response's :func:`skeleton` must equal the skeleton of the reference trace of the procedure its
    tag names: same operands, carries and number of steps, and the exact answer (intermediate results
    are not checked). This closes the set of rewarded behaviours: a bare ``|621``, a column trace that
    leaves out its last column (``c:3+8=11;7+4+1=12|621`` fits a budget the full trace does not) or a
    trace whose tag was lost all score 0, so every rewarded rollout has a parser label and the niches
    cannot be eroded by shortening a procedure.
    """
    if len(completion) > budget or len(completion) < 2 or completion[1] != ":" or completion[0] not in TRACERS:
        return 0.0
    return float(skeleton(completion) == skeleton(TRACERS[completion[0]](a, b)))
