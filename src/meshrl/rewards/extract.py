"""Strict final-answer extraction from a model completion.

Rule (first that applies wins; see :func:`extract_answer`):

1. the LAST complete, non-empty ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces; nested braces
   allowed), or the brace-less form ``\\boxed 5`` (one token). This is the MATH convention (Hendrycks
   et al. 2021) that the reference solutions of MATH-500 use; "last" follows the usual MATH/PRM800K
   graders.
2. else the LAST complete ``<answer>...</answer>`` tag (the DeepSeek-R1 / reasoning-gym format);
3. else a final-answer statement in the last :data:`TAIL_LINES` non-empty lines: ``#### X`` (the GSM8K
   convention, Cobbe et al. 2021), ``Answer: X`` / ``Final answer: X`` at the start of a line, or
   ``... answer is X`` / ``answer = X`` anywhere in those lines (the last one wins);
4. else ``None``.

There is deliberately NO fallback to the raw completion or to "the last number in the text": such a
fallback rewards a completion that merely restates the question (whose numbers often include the
answer), a well-known reward hack for RLVR. An unterminated ``\\boxed{`` or ``<answer>`` (a truncated
completion) is ignored.

The permissive alternative, for the reward kind ``last_number`` only, is :func:`extract_last_number`: the
last number anywhere in the completion. It accepts a bare ``8`` or ``7 + 1 = 8``, and shares the weakness
above: a completion that restates the question, or stops at an intermediate result, is read at whatever
number happens to come last.
"""

from __future__ import annotations

import re

__all__ = ["TAIL_LINES", "extract_answer", "extract_boxed", "extract_last_number", "strip_math_delimiters"]

#: How many trailing non-empty lines may hold a final-answer statement (rule 3).
TAIL_LINES = 3

_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# Final-answer statements (rule 3). Each captures the rest of the line after the cue.
_STATEMENTS = (
    re.compile(r"####\s*(?P<x>.+)$", re.MULTILINE),
    re.compile(
        r"^[\s>*_#-]*(?:the\s+)?(?:final\s+)?answer[\s*_]*:[\s*_]*(?P<x>.+)$",
        re.IGNORECASE | re.MULTILINE,
    ),
    re.compile(r"\banswer\s*(?:is|=)\s*:?\s*(?P<x>.+)$", re.IGNORECASE | re.MULTILINE),
)
# The last number (``last_number`` kind): a minus sign only where it cannot be a subtraction (not after a
# digit, letter, closing bracket or point); digits that continue a word (``step2``, ``H2O``) or a dotted
# run (``1.2.3``) are not a number; thousands separators (``,``, LaTeX ``{,}`` and ``\,``) only in
# well-formed groups of three; optional decimals or a bare ``.5``; a fraction ``7/2`` or ``\frac{7}{2}``
# is one number (``parse_number`` reads each form, so the strict ``number`` kind and this one agree on it).
_DECIMAL = r"(?<![\w.])(?:(?:\d{1,3}(?:(?:,|\{,\}|\\,)\d{3})+(?![\d,])|\d+)(?:\.\d+)?|\.\d+)"
_LAST_NUMBER = re.compile(
    r"(?:(?<![\w)\].])[-\u2212])?"
    rf"(?:\\[dt]?frac\{{\s*\d+\s*\}}\{{\s*\d+\s*\}}|{_DECIMAL}(?:\s*/\s*\d+(?!\d|[.,]\d))?)"
)
# End of the first sentence: a full stop (or ! ?) followed by whitespace or the end, not a decimal point.
_SENTENCE_END = re.compile(r"(?<=\S)[.!?](?=\s|$)")
_DELIMS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**"), ("__", "__"), ("`", "`"))


def _match_brace(text: str, open_pos: int) -> int:
    """Return the index of the ``}`` closing the ``{`` at ``open_pos``, or -1 if unbalanced.

    Escaped braces (``\\{`` / ``\\}``) are part of the content and do not count.
    """
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (else ``None``).

    Scans left to right and skips over each box it reads, so for ``\\boxed{\\boxed{1}}`` the outer box is
    the one returned (its content is then unwrapped: ``1``). Empty boxes are skipped. ``\\boxed 5`` (no
    braces) yields the single token after the space, without a trailing full stop.
    """
    last: str | None = None
    pos = 0
    while True:
        m = _BOX_CMD.search(text, pos)
        if m is None:
            break
        j = m.end()
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            end = _match_brace(text, j)
            if end < 0:  # unterminated (truncated) box: ignore it and everything after
                break
            content = text[j + 1 : end].strip()
            if content:  # an empty box (e.g. a restated "within \boxed{}" instruction) holds no answer
                last = content
            pos = end + 1
        elif j > m.end() and j < len(text):
            tok = re.match(r"[^\s${}]+", text[j:])
            if tok and tok.group(0).rstrip(".,;"):
                last = tok.group(0).rstrip(".,;")
            pos = j + (tok.end() if tok else 0)
        else:
            pos = m.end()
    if last is not None:
        whole = _BOX_CMD.match(last)  # \boxed{\boxed{x}} -> x, only when one box is the whole content
        if whole:
            k = last.find("{", whole.end())
            if k >= 0 and not last[whole.end() : k].strip() and _match_brace(last, k) == len(last) - 1:
                last = extract_boxed(last) or last
    return last


def strip_math_delimiters(s: str) -> str:
    """Strip surrounding whitespace and wrapping ``$..$``, ``\\(..\\)``, ``\\[..\\]``, ``**..**`` pairs."""
    s = s.strip()
    changed = True
    while changed and s:
        changed = False
        for left, right in _DELIMS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left) : len(s) - len(right)].strip()
                changed = True
    return s


def _clean_statement(x: str) -> str | None:
    """Cut a statement's captured text at the end of its first sentence and strip delimiters."""
    x = x.strip()
    # Keep whole $...$ spans intact before looking for the sentence end.
    if x.startswith("$"):
        close = x.find("$", 2 if x.startswith("$$") else 1)
        if close > 0:
            end = close + (2 if x.startswith("$$") else 1)
            x = x[:end]
    m = _SENTENCE_END.search(x)
    if m:
        x = x[: m.start()]
    x = strip_math_delimiters(x.strip().rstrip(".,;:")).rstrip(".,;:").strip()
    inner = extract_boxed(x)
    if inner is not None:
        x = inner
    return x or None


def _statement_answer(text: str) -> str | None:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    tail = "\n".join(lines[-TAIL_LINES:])
    best: tuple[int, str] | None = None
    for pat in _STATEMENTS:
        for m in pat.finditer(tail):
            if best is None or m.start("x") > best[0]:
                best = (m.start("x"), m.group("x"))
    return _clean_statement(best[1]) if best else None


def extract_answer(completion: str) -> str | None:
    """Extract the final answer of ``completion``, or ``None`` when it states none.

    Precedence: last ``\\boxed{}``/``\\fbox{}`` > last ``<answer>...</answer>`` > a final "#### X",
    "Answer: X" or "the answer is X" statement in the last :data:`TAIL_LINES` non-empty lines. Never
    falls back to the raw completion. See the module docstring for the rule and its sources.
    """
    if not isinstance(completion, str):
        raise ValueError(f"completion must be a str, got {type(completion).__name__}")
    boxed = extract_boxed(completion)
    if boxed is not None:
        return boxed
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        ans = strip_math_delimiters(tags[-1])
        return ans or None
    return _statement_answer(completion)


def extract_last_number(completion: str) -> str | None:
    """The last number in ``completion`` (``-3``, ``1,234``, ``-.5``, ``7/2``, ``\\frac{7}{2}``), or ``None``.

    Rule: numbers are read left to right with :data:`_LAST_NUMBER` and the last one wins, wherever it
    stands (inside ``\\boxed{}``, after ``=``, alone). A minus sign counts only where it cannot be a
    subtraction (``5-3`` ends with ``3``); ``1,23`` is ``1`` then ``23``; digits inside a word (``step2``,
    ``H2O``) are not a number; a fraction (``7/2``, ``\\frac{7}{2}``) is one number and ``1{,}234`` is
    ``1234``; other LaTeX (``10^{3}``, ``\\sqrt{2}``) is read as its last plain number. Known weakness:
    restated numbers or intermediate results that happen to come last are taken as the answer (see the
    module docstring), so this is for the ``last_number`` reward kind only, never the default.
    """
    if not isinstance(completion, str):
        raise ValueError(f"completion must be a str, got {type(completion).__name__}")
    last = None
    for last in _LAST_NUMBER.finditer(completion):  # noqa: B007 - the last match is the one wanted
        pass
    return None if last is None else last.group(0).replace("\u2212", "-")
