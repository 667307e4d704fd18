"""``grade(completion, reference, kind)``: the verifiable reward of one completion, in [0, 1].

Every kind but ``last_number`` grades the *extracted* final answer (:func:`meshrl.rewards.extract_answer`),
never the raw completion; a completion without a final answer scores 0. Kinds:

- ``math``: normalised-string equality (:func:`~meshrl.rewards.normalize.normalize_latex`), then
  math-verify (Hugging Face, ``parse`` + ``verify``) on the extracted answer and the reference, both
  wrapped as ``\\boxed{...}``. Word answers (``\\text{Evelyn}``) are compared as text only, because
  math-verify reads a bare word as a product of symbols (``Evelyn`` == ``Nevely``).
- ``number``: one real number (:func:`~meshrl.rewards.normalize.parse_number`), equal within
  ``rel_tol=1e-6`` / ``abs_tol=1e-9``; the GSM8K convention.
- ``last_number``: the last number anywhere in the completion (a decimal, ``7/2`` or ``\\frac{7}{2}``;
  :func:`~meshrl.rewards.extract.extract_last_number`), compared as ``number``. The permissive
  alternative to ``number`` (a bare ``8`` or ``7 + 1 = 8`` scores), with a known weakness: it rewards a
  completion whose last number is a restated number of the question or an intermediate result that happens
  to equal the answer, so a policy can learn to end on a number rather than to state a result.
- ``choice``: the option letter A-J (:func:`~meshrl.rewards.normalize.choice_letter`).
- ``exact``: equal after :func:`~meshrl.rewards.normalize.normalize_exact`.

math-verify's own timeouts use ``signal.alarm`` (main thread only), so they are disabled here
(``parsing_timeout=None``, ``timeout_seconds=None``); ``grade`` itself has no time limit. Run it under
:class:`meshrl.rewards.RewardRunner`, which applies one. Answers longer than
:data:`MAX_SYMBOLIC_CHARS`, and power towers / huge exponents / huge factorials, skip the symbolic step
(string equality only) to bound sympy's work.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from meshrl.errors import MissingDependency
from meshrl.rewards.extract import extract_answer, extract_last_number
from meshrl.rewards.normalize import (
    choice_letter,
    normalize_exact,
    normalize_latex,
    parse_number,
    unwrap_text,
)

__all__ = ["MAX_SYMBOLIC_CHARS", "REWARD_KINDS", "check_reference", "extract_for_kind", "grade", "grade_answer",
           "math_equal", "symbolic_equal"]

#: The kinds :func:`grade` accepts.
REWARD_KINDS: tuple[str, ...] = ("math", "number", "last_number", "choice", "exact")

#: Answers (or references) longer than this are compared as normalised strings only.
MAX_SYMBOLIC_CHARS = 400

_REL_TOL = 1e-6
_ABS_TOL = 1e-9
_WORDS = re.compile(r"^\(?[A-Za-z][A-Za-z' ]*\)?$")
# Inputs whose sympy evaluation can take minutes and gigabytes: a numeric power tower (9^{9^{9}},
# 2^{3 \cdot 10^{6}}, 9^9^9), an exponent literal of 5+ digits, or the factorial of a 4+ digit number.
_COSTLY = re.compile(r"\d\s*\^\s*\{[^{}]*\d\s*\^|\d\s*\^\s*\d+\s*\^|\^\s*[{(]*\s*\d{5,}|\d{4,}\s*!")


class _DropDisabledTimeoutWarning(logging.Filter):
    """Drop math-verify's one-off "Timeout is disabled" warning: the timeout is ours (RewardRunner)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@lru_cache(maxsize=1)
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any], list[Any]]:
    """Import math-verify lazily (optional extra ``meshrl[math]``); return (parse, verify, config)."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency(
            "grade(kind='math') needs math-verify for non-identical answers: pip install 'meshrl[math]'"
        ) from exc
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropDisabledTimeoutWarning())
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse, verify, config


def _is_word_answer(s: str) -> bool:
    """True when ``s`` is a word answer (``\\text{Evelyn}``, ``odd``, ``(C)``), not a formula.

    Rule: after unwrapping ``\\text{}`` it is letters/spaces only (optionally in parentheses), and it
    either was wrapped in a text command or has at least three letters (so ``xy`` stays a product).
    """
    bare = unwrap_text(s).strip().rstrip(".")
    if not _WORDS.match(bare):
        return False
    return bare != s.strip().rstrip(".") or sum(c.isalpha() for c in bare) >= 3


def _word_key(s: str) -> str:
    return re.sub(r"[\s()]", "", unwrap_text(s)).rstrip(".").casefold()


def math_equal(answer: str, reference: str) -> bool:
    """Whether the extracted ``answer`` equals the LaTeX ``reference`` (the ``math`` rule above)."""
    if normalize_latex(answer) == normalize_latex(reference):
        return True
    if _is_word_answer(reference):
        return _word_key(answer) == _word_key(reference)
    return symbolic_equal(answer, reference)


def symbolic_equal(answer: str, reference: str) -> bool:
    """The math-verify step alone: both wrapped in ``\\boxed{}``, parsed and ``verify``-ed (gold first).

    Inputs longer than :data:`MAX_SYMBOLIC_CHARS`, and costly ones (a numeric power tower such as ``9^{9^{9}}``,
    an exponent of 5+ digits, the factorial of a 4+ digit number), give ``False`` without calling sympy.
    """
    if len(answer) > MAX_SYMBOLIC_CHARS or len(reference) > MAX_SYMBOLIC_CHARS:
        return False
    if _COSTLY.search(answer) or _COSTLY.search(reference):
        return False
    parse, verify, config = _math_verify()
    gold = parse(f"\\boxed{{{reference}}}", config, parsing_timeout=None)
    pred = parse(f"\\boxed{{{answer}}}", config, parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _number_equal(answer: str, reference: str) -> bool:
    a, r = parse_number(answer), parse_number(reference)
    if r is None:
        raise ValueError(f"reference {reference!r} is not a number (kind 'number')")
    return a is not None and math.isclose(a, r, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)


def _choice_equal(answer: str, reference: str) -> bool:
    r = choice_letter(reference)
    if r is None:
        raise ValueError(f"reference {reference!r} is not a choice letter A-J (kind 'choice')")
    return choice_letter(answer) == r


_GRADERS: dict[str, Callable[[str, str], bool]] = {
    "math": math_equal,
    "number": _number_equal,
    "last_number": _number_equal,
    "choice": _choice_equal,
    "exact": lambda a, r: normalize_exact(a) == normalize_exact(r),
}


def _check_kind(kind: object) -> str:
    if not isinstance(kind, str) or kind not in _GRADERS:
        raise ValueError(f"unknown reward kind {kind!r}; known: {', '.join(REWARD_KINDS)}")
    return kind


def extract_for_kind(completion: str, kind: str) -> str | None:
    """The answer :func:`grade` compares for ``kind``: the last number for ``last_number``, else the strict
    :func:`extract_answer` (also for kinds graded by a task's own scorer)."""
    return extract_last_number(completion) if kind == "last_number" else extract_answer(completion)


def check_reference(reference: str, kind: str) -> str | None:
    """Why ``reference`` can never be matched under ``kind`` (``None`` when it can): ``number`` and
    ``last_number`` need one finite real number (so ``NaN``/``inf`` are refused), ``choice`` a letter A-J."""
    if kind in ("number", "last_number") and parse_number(reference) is None:
        return f"is not a finite number (reward kind {kind!r}), got {reference!r}"
    if kind == "choice" and choice_letter(reference) is None:
        return f"is not a choice letter A-J (reward kind 'choice'), got {reference!r}"
    return None


def grade_answer(answer: str, reference: str, kind: str) -> float:
    """Grade an already extracted ``answer`` against ``reference``: 1.0 or 0.0."""
    kind = _check_kind(kind)
    for name, value in (("answer", answer), ("reference", reference)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a str, got {type(value).__name__}")
    return 1.0 if _GRADERS[kind](answer.strip(), reference.strip()) else 0.0


def grade(completion: str, reference: str, kind: str) -> float:
    """Reward of ``completion`` against ``reference`` for ``kind`` (one of :data:`REWARD_KINDS`).

    Returns 1.0 when the extracted final answer matches, else 0.0 (also when there is no final answer).
    Raises ``ValueError`` for an unknown kind, a non-string argument (naming it) or a reference that is
    not valid for its kind (``number``: not a number; ``choice``: not a letter).
    """
    kind = _check_kind(kind)
    if not isinstance(completion, str):
        raise ValueError(f"completion must be a str, got {type(completion).__name__}")
    if not isinstance(reference, str):
        raise ValueError(f"reference must be a str, got {type(reference).__name__}")
    answer = extract_for_kind(completion, kind)
    if answer is None:
        if kind in ("number", "last_number", "choice"):  # still reject an invalid reference loudly
            grade_answer("", reference, kind)
        return 0.0
    return grade_answer(answer, reference, kind)
