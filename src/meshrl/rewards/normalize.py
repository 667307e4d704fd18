"""String normalisers used by the graders: LaTeX answer strings, numbers, choice letters, free text.

Each function states its rule. The LaTeX normaliser follows the spirit of the MATH answer normaliser
(Hendrycks et al. 2021, ``is_equiv``/``strip_string``): it only removes presentation (``\\left``,
``\\text{}``, spacing, ``^\\circ``, ``\\%``, ``\\$``, ``\\dfrac``) so that two strings it maps to the same
value denote the same answer; anything semantic is left to math-verify.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "choice_letter",
    "normalize_exact",
    "normalize_latex",
    "parse_number",
    "unwrap_text",
]

_TEXT_CMDS = r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname)"
_TEXT_WRAP = re.compile(_TEXT_CMDS + r"\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:!> ]|\\quad|\\qquad|~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![A-Za-z])")
_FRAC_VARIANTS = re.compile(r"\\[dt]frac(?![A-Za-z])")
_UNICODE_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-"})


def unwrap_text(s: str) -> str:
    """Replace every ``\\text{X}`` (and ``\\textbf``, ``\\mathrm``, ``\\mbox``, ...) by ``X``, innermost first."""
    prev = None
    while prev != s:
        prev = s
        s = _TEXT_WRAP.sub(r"\1", s)
    return s


def normalize_latex(s: str) -> str:
    """Presentation-only normal form of a LaTeX answer, for a cheap equality test.

    Rule: unwrap ``\\text{}``-like commands; drop ``\\left``/``\\right`` (and ``\\big`` sizes), LaTeX spacing
    commands, degree marks (``^\\circ``, ``^{\\circ}``, ``°``), ``\\%``/``%``, ``\\$``/``$``, all whitespace
    and a trailing full stop; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; unicode minus -> ``-``.
    """
    s = s.translate(_UNICODE_MINUS)
    s = unwrap_text(s)
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub("", s)
    s = _DEGREES.sub("", s)
    s = _FRAC_VARIANTS.sub(r"\\frac", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


# A number: optional sign, digits with optional thousands separators (all commas or all spaces, groups
# of three), optional decimals; or ".5".
_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUMBER_ONLY = re.compile(rf"^(?P<n>{_NUM})$")
_FRACTION = re.compile(rf"^(?P<a>{_NUM})\s*/\s*(?P<b>{_NUM})$")
_LATEX_FRACTION = re.compile(r"^(?P<sign>[-+]?)\\frac\{(?P<a>[^{}]+)\}\{(?P<b>[^{}]+)\}$")
_TRAILING_WORDS = re.compile(r"^(?P<n>.*?\d)\s*(?:[A-Za-z][A-Za-z.'/\s]*)?$")


def _to_float(tok: str) -> float | None:
    tok = tok.strip()
    if not _NUMBER_ONLY.match(tok):
        return None
    return float(tok.replace(",", "").replace(" ", ""))


def parse_number(s: str) -> float | None:
    """Parse an extracted answer as a single real number, or ``None``.

    Rule: unwrap ``\\text{}``; drop ``\\$``/``$``, ``\\%``/``%``, ``\\!``/``\\,`` spacing, degree marks and
    a trailing full stop; when the answer is an equation (``x = 18``) keep its right-hand side; drop
    trailing unit words (``18 dollars``, ``5 km/h``); then accept ``1234``, thousands separators
    ``1,234`` / ``1{,}234`` / ``1 234`` / ``1\\,234`` (well-formed groups of three only), ``-3.5``,
    ``.5``, ``7/2`` or ``\\frac{7}{2}``. Anything else (two numbers, words before the number, ``1,23``)
    is ``None``, so it never matches.
    """
    s = s.translate(_UNICODE_MINUS).replace("\u202f", " ").replace("\u2009", " ").replace("\xa0", " ")
    s = unwrap_text(s).replace("{,}", ",")
    s = _DEGREES.sub("", s)
    s = re.sub(r"(?<=\d)\\[,;: ](?=\d{3})", " ", s)  # 1\,000 -> 1 000 (LaTeX thin-space separator)
    s = re.sub(r"\\[,!;: ]", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _FRAC_VARIANTS.sub(r"\\frac", s)
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    m = _TRAILING_WORDS.match(s)
    if m:
        s = m.group("n").strip()
    value = _to_float(s)
    if value is None:
        frac = _FRACTION.match(s)
        sign = ""
        if frac is None:
            frac = _LATEX_FRACTION.match(s)
            sign = frac.group("sign") if frac else ""
        if frac is not None:
            a, b = _to_float(frac.group("a")), _to_float(frac.group("b"))
            if a is not None and b is not None and b != 0:
                value = (-a if sign == "-" else a) / b
    if value is None or not math.isfinite(value):
        return None
    return value


_CHOICE_PREFIX = re.compile(r"^(?:the\s+)?(?:correct\s+)?(?:option|choice|answer)?\s*(?:is\s*)?:?\s*", re.I)
_CHOICE = re.compile(r"^(?:\(\s*(?P<p>[A-J])\s*\)|\[(?P<b>[A-J])\]|(?P<l>[A-J])(?=$|[.:)\s]))", re.I)


def choice_letter(s: str) -> str | None:
    """The multiple-choice letter (A-J, upper case) an answer names, or ``None``.

    Rule: unwrap ``\\text{}``/``\\textbf{}`` and ``$``, drop an optional "the correct option/choice/answer
    is" prefix, then accept ``(B)``, ``[B]``, a bare ``B``, or ``B)``, ``B.``, ``B:`` followed by the option
    text. A bare letter followed by a space and a word is read as a word, not an option (``I think B``,
    ``A lot``), so it gives ``None``.
    """
    s = unwrap_text(s).replace("$", "").strip()
    s = _CHOICE_PREFIX.sub("", s, count=1).strip()
    m = _CHOICE.match(s)
    if m is None:
        return None
    letter = m.group("p") or m.group("b") or m.group("l")
    rest = s[m.end() :]
    if m.group("l") and rest[:1].isspace() and rest.strip():
        return None  # "I think B", "A lot": a letter followed by a word is a word, not an option
    return letter.upper()


def normalize_exact(s: str) -> str:
    """Normal form for ``exact`` grading: unwrap a whole-answer ``\\text{}``, casefold, collapse whitespace.

    A trailing full stop is dropped too (``Yes.`` == ``yes``).
    """
    s = unwrap_text(s.strip())
    s = re.sub(r"\s+", " ", s).strip().casefold()
    return s.rstrip(".").strip()
