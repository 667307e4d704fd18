"""Parsing and validation of coach answers: every rejection comes with a reason string.

Checks (docs/method.md §1.3): the answer parses as JSON (code fences and a leading ``<think>`` block are
tolerated), holds exactly m prefixes, each within a length bound, pairwise distinct (exact after
normalisation, and near-duplicates by token Jaccard similarity), and none leaks the reference answer.

Leak check, by the kind of reference answer:

- numeric (``42``, ``-3.5``, ``1,000``, ``3/4``, ``\\frac{3}{4}``, ``\\boxed{12}``): leak when a
  number token of the prefix has the same absolute value (``12`` in "try 12 cases" leaks 12, and so
  does ``0.75`` or ``3/4`` for ``\\frac{3}{4}``). Digits inside other numbers do not count (``12`` is
  not found in ``312``). Small answers (0, 1, 2) will reject some harmless prefixes; a retry asks the
  coach again, and the reason is written to the rejects file.
- other text of >= 3 alphanumeric characters (``x^2+1``, ``\\sqrt{2}``, ``Paris``): leak when its
  alphanumeric skeleton is a substring of the prefix's skeleton (case-insensitive).
- shorter text (a choice letter such as ``B``): leak only in answer-like phrases ("answer is B",
  "option B", "(B)", "= B"); bare containment would fire on every article "a".
Reason strings never contain the reference answer itself.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from fractions import Fraction

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+(?:\.\d+)?)\s*\}\s*\{\s*(-?\d+(?:\.\d+)?)\s*\}")
_NUM = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:\s*/\s*(\d+(?:\.\d+)?))?(?![\d])")


class CoachParseError(ValueError):
    """The coach's answer is not the expected JSON; ``str(e)`` is the rejection reason."""


@dataclass(frozen=True)
class PrefixRules:
    """Validation thresholds. Lengths are per prefix; ``jaccard`` rejects pairs at or above it."""

    m: int = 4
    min_words: int = 3
    max_words: int = 80
    max_chars: int = 600
    jaccard: float = 0.7
    check_leak: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 1:
            raise ValueError(f"m must be an integer >= 1, got {self.m!r}")
        if not 0 <= self.min_words <= self.max_words:
            raise ValueError(f"need 0 <= min_words <= max_words, got {self.min_words}, {self.max_words}")
        if self.max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {self.max_chars}")
        if not 0 < self.jaccard <= 1:
            raise ValueError(f"jaccard must be in (0, 1], got {self.jaccard}")


def normalize_text(text: str) -> str:
    """NFKC, lower case, every run of non-alphanumeric characters replaced by one space."""
    t = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[\W_]+", " ", t).split())


def _tokens(text: str) -> set[str]:
    return set(normalize_text(text).split())


def jaccard(a: str, b: str) -> float:
    """Token-set Jaccard similarity of two texts after :func:`normalize_text` (1.0 for two empties)."""
    ta, tb = _tokens(a), _tokens(b)
    if not ta and not tb:
        return 1.0
    return len(ta & tb) / len(ta | tb)


def _json_candidates(text: str) -> list[str]:
    body = _THINK.sub("", text).strip()
    out = [m.group(1).strip() for m in _FENCE.finditer(body)]
    out.append(body)
    lo, hi = body.find("{"), body.rfind("}")
    if 0 <= lo < hi:
        out.append(body[lo : hi + 1])
    return out


def parse_strategies(text: str) -> list[dict[str, str]]:
    """Parse a coach answer into ``[{"name": str, "prefix": str}, ...]``.

    Accepted shapes: ``{"strategies": [{"name": ..., "prefix": ...}, ...]}`` (the requested one),
    a bare list of such objects, or lists of plain strings (then ``name`` is ``""``); the JSON may be
    wrapped in a code fence or surrounded by text. Raises :class:`CoachParseError` with the reason.
    """
    if not isinstance(text, str) or not text.strip():
        raise CoachParseError("empty answer")
    data = None
    for cand in _json_candidates(text):
        try:
            data = json.loads(cand)
            break
        except json.JSONDecodeError:
            continue
    if data is None:
        raise CoachParseError("answer is not parsable JSON")
    items = data.get("strategies") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise CoachParseError("JSON has no 'strategies' list")
    out = []
    for k, item in enumerate(items, 1):
        if isinstance(item, str):
            name, prefix = "", item
        elif isinstance(item, dict):
            name, prefix = item.get("name", ""), item.get("prefix")
        else:
            raise CoachParseError(f"strategy {k} is neither an object nor a string")
        if not isinstance(prefix, str) or not prefix.strip():
            raise CoachParseError(f"strategy {k} has no non-empty 'prefix' string")
        if not isinstance(name, str):
            raise CoachParseError(f"strategy {k} has a 'name' that is not a string")
        out.append({"name": " ".join(name.split()), "prefix": " ".join(prefix.split())})
    return out


def _to_float(s: str) -> float | None:
    try:
        return float(Fraction(s.replace(",", "")))
    except (ValueError, ZeroDivisionError):
        return None


def answer_number(answer: str) -> float | None:
    """The reference answer as a number, or ``None`` when it is not a single number."""
    s = unicodedata.normalize("NFKC", str(answer)).strip()
    s = re.sub(r"^\\boxed\s*\{(.*)\}$", r"\1", s.strip("$ ")).strip()
    s = s.replace("\\!", "").replace("\\,", "").replace("\\%", "").replace("%", "").replace("^\\circ", "")
    s = s.replace("−", "-").strip().rstrip(".").replace(" ", "")
    m = _FRAC.fullmatch(s.lstrip("-"))
    if m:
        den = _to_float(m.group(2))
        if not den:
            return None
        val = (_to_float(m.group(1)) or 0.0) / den
        return -val if s.startswith("-") else val
    if re.fullmatch(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?(/\d+)?|[-+]?\.\d+", s):
        return _to_float(s)
    return None


def number_tokens(text: str) -> list[float]:
    """Absolute values of the numbers written in ``text``: integers, decimals, ``a/b`` and ``\\frac``.

    For a fraction both the quotient and its two parts are returned.
    """
    t = unicodedata.normalize("NFKC", text)
    vals: list[float] = []
    for m in _FRAC.finditer(t):
        a, b = _to_float(m.group(1)), _to_float(m.group(2))
        vals += [abs(v) for v in (a, b) if v is not None]
        if a is not None and b:
            vals.append(abs(a / b))
    t = _FRAC.sub(" ", t)
    for m in _NUM.finditer(t):
        whole = m.group(1).replace(",", "") + (f".{m.group(2)}" if m.group(2) else "")
        a = float(whole)
        vals.append(a)
        if m.group(3) is not None:
            b = float(m.group(3))
            vals.append(b)
            if b:
                vals.append(a / b)
    return vals


def _skeleton(text: str) -> str:
    t = unicodedata.normalize("NFKC", text).lower()
    t = re.sub(r"\\(boxed|text|mathrm|left|right|displaystyle)", "", t)
    return "".join(ch for ch in t if ch.isalnum())


def leaks_answer(text: str, answer: str) -> str | None:
    """Why ``text`` leaks the reference ``answer`` (a reason without the answer), or ``None``."""
    if answer is None or not str(answer).strip():
        return None
    num = answer_number(str(answer))
    if num is not None:
        target = abs(num)
        tol = 1e-9 * max(1.0, target)
        if any(abs(v - target) <= tol for v in number_tokens(text)):
            return "contains the reference answer as a number"
        return None
    skel = _skeleton(str(answer))
    if not skel:
        return None
    if len(skel) >= 3:
        return "contains the reference answer text" if skel in _skeleton(text) else None
    tok = re.escape(skel)
    pattern = rf"(answer\s*(is|:|=)?|option|choice)\s*\(?\s*{tok}\b|\(\s*{tok}\s*\)|=\s*{tok}\b"
    if re.search(pattern, unicodedata.normalize("NFKC", text).lower()):
        return "states the reference answer in an answer-like phrase"
    return None


def validate_strategies(strategies: list[dict[str, str]], answer: str | None, rules: PrefixRules) -> list[str]:
    """All reasons to reject a parsed coach answer (empty list = accepted). Indices are 1-based."""
    reasons: list[str] = []
    if len(strategies) != rules.m:
        reasons.append(f"expected exactly {rules.m} strategies, got {len(strategies)}")
    prefixes = [s["prefix"] for s in strategies]
    for k, s in enumerate(strategies, 1):
        p = s["prefix"]
        words = len(p.split())
        if words < rules.min_words:
            reasons.append(f"prefix {k} is too short ({words} words < {rules.min_words})")
        if words > rules.max_words:
            reasons.append(f"prefix {k} is too long ({words} words > {rules.max_words})")
        if len(p) > rules.max_chars:
            reasons.append(f"prefix {k} is too long ({len(p)} chars > {rules.max_chars})")
        if rules.check_leak and answer is not None:
            why = leaks_answer(f"{s.get('name', '')}\n{p}", answer)
            if why:
                reasons.append(f"prefix {k} {why}")
    for i in range(len(prefixes)):
        for j in range(i + 1, len(prefixes)):
            if normalize_text(prefixes[i]) == normalize_text(prefixes[j]):
                reasons.append(f"prefixes {i + 1} and {j + 1} are identical")
                continue
            sim = jaccard(prefixes[i], prefixes[j])
            if sim >= rules.jaccard:
                reasons.append(
                    f"prefixes {i + 1} and {j + 1} are near-duplicates (token Jaccard {sim:.2f} >= {rules.jaccard})"
                )
    return reasons


def check_answer(text: str, answer: str | None, rules: PrefixRules) -> tuple[list[dict[str, str]], list[str]]:
    """Parse and validate one coach answer: ``(strategies, reasons)``; accepted iff ``reasons == []``."""
    try:
        strategies = parse_strategies(text)
    except CoachParseError as e:
        return [], [str(e)]
    return strategies, validate_strategies(strategies, answer, rules)
