"""meshrl.rewards: strict final-answer extraction and the graders of each reward kind."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.rewards import (
    REWARD_KINDS,
    choice_letter,
    extract_answer,
    grade,
    grade_answer,
    normalize_latex,
    parse_number,
)

# ----------------------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are content
        (r"first \boxed{1} then \boxed{2}", "2"),  # the last box wins
        (r"\boxed{\boxed{7}}", "7"),  # nested box unwrapped
        (r"\fbox{12}", "12"),
        (r"\boxed {12}", "12"),
        (r"so the result is $\boxed 5$.", "5"),
        (r"\boxed 5.", "5"),
        (r"\boxed{3} and then \boxed{4", "3"),  # an unterminated (truncated) box is ignored
        (r"\boxed{42}. (I put the final answer within \boxed{}.)", "42"),  # empty boxes are skipped
        (r"\boxed{\boxed{1} + \boxed{2}}", r"\boxed{1} + \boxed{2}"),  # not one nested box: kept whole
        (r"\boxed .", None),
        ("<think>hmm 7</think><answer> 42 </answer>", "42"),
        ("<answer>1</answer> wait <answer>2</answer>", "2"),
        ("<answer>$x+1$</answer>", "x+1"),
        (r"<answer>\boxed{9}</answer>", "9"),
        ("Adding up, we get 42.\nThe answer is 42.", "42"),
        ("The final answer is: $\\frac{3}{4}$.", r"\frac{3}{4}"),
        ("The answer is 3.5.", "3.5"),
        ("The answer is $3.$", "3"),
        ("The answer is \\(5\\).", "5"),
        ("Therefore, the answer is **17**", "17"),
        ("Work...\nAnswer: (B) the cat", "(B) the cat"),
        ("Work...\n**Final Answer:** 12", "12"),
        ("Work...\n**Final Answer**: 12", "12"),
        ("She makes 9 * 2 = $18.\n#### 18", "18"),
        ("#### 1,000", "1,000"),
        (r"\boxed{} and nothing else", None),
    ],
)
def test_extract_answer(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "Janet's ducks lay 16 eggs per day. She eats 3 and bakes with 4. She sells the rest for $2. So 18.",
        "What is 6 times 7? 42",  # restating with the right number but no final-answer statement
        "The answer is",  # a cue with nothing after it
        "\\boxed{",
        "<answer>42",  # unterminated tag
        "The answer is 42.\nline\nline\nline\nline",  # the statement is not near the end
    ],
)
def test_extract_answer_none(completion: str) -> None:
    assert extract_answer(completion) is None


def test_precedence_boxed_over_tag_over_statement() -> None:
    assert extract_answer("The answer is 1.\n<answer>2</answer>\n\\boxed{3}") == "3"
    assert extract_answer("<answer>2</answer>\nThe answer is 1.") == "2"


def test_no_fallback_to_raw_completion_scores_zero() -> None:
    restated = "Natalia sold clips to 48 friends in April, and half as many in May: 48 + 24 = 72 clips."
    assert extract_answer(restated) is None
    for kind in ("math", "number", "exact"):
        assert grade(restated, "72", kind) == 0.0
    assert grade("B", "B", "choice") == 0.0  # a bare completion is not an extracted answer


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\\<#"), max_size=200))
def test_plain_text_without_cues_has_no_answer(text: str) -> None:
    if "answer" not in text.lower():
        assert extract_answer(text) is None


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="{}\\"), min_size=1, max_size=40))
def test_boxed_roundtrip(content: str) -> None:
    got = extract_answer(f"work... \\boxed{{{content}}} done")
    assert got == (content.strip() or None)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=300))
def test_extract_never_raises(text: str) -> None:
    out = extract_answer(text)
    assert out is None or (isinstance(out, str) and out)


# --------------------------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        (r"\frac{1}{2}", "0.5"),
        ("0.5", r"\frac{1}{2}"),
        (r"\dfrac{14}{3}", r"\frac{14}{3}"),
        (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)"),
        ("Evelyn", r"\text{Evelyn}"),
        (r"\text{Evelyn}", r"\text{Evelyn}"),
        ("C", r"\text{(C)}"),
        ("10", r"10\%"),
        (r"10\%", r"10\%"),
        ("30", r"30^\circ"),
        (r"30^{\circ}", r"30^\circ"),
        ("18.90", r"\$18.90"),
        ("p-q", "p - q"),
        ("3+2x", "2x+3"),
        (r"\frac{\sqrt2}{2}", r"\frac{\sqrt{2}}{2}"),
        ("[-2, 7]", r"x \in [-2,7]"),
        ("1,000", "1000"),
        ("42.", "42"),
    ],
)
def test_math_accepts_equivalent(answer: str, reference: str) -> None:
    assert grade(f"Reasoning... so \\boxed{{{answer}}}.", reference, "math") == 1.0


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        (r"\frac{1}{3}", "0.5"),
        ("0.333", r"\frac{1}{3}"),
        ("Nevely", r"\text{Evelyn}"),  # sympy would read both as the same product of letters
        ("Evelyn Smith", r"\text{Evelyn}"),
        ("(3, \\pi)", r"\left( 3, \frac{\pi}{2} \right)"),
        ("41, 42", "42"),
        (r"41 \text{ or } 42", "42"),
        ("D", r"\text{(C)}"),
        ("p+q", "p - q"),
    ],
)
def test_math_rejects_wrong(answer: str, reference: str) -> None:
    assert grade(f"\\boxed{{{answer}}}", reference, "math") == 0.0


def test_math_costly_answer_is_rejected_fast() -> None:
    t0 = time.perf_counter()
    assert grade(r"\boxed{9^{9^{9}}}", "1", "math") == 0.0
    assert grade(r"\boxed{100000!}", "1", "math") == 0.0
    assert time.perf_counter() - t0 < 1.0


def test_normalize_latex() -> None:
    assert normalize_latex(r"\left( 3, \dfrac{\pi}{2} \right).") == r"(3,\frac{\pi}{2})"
    assert normalize_latex(r"\text{Evelyn}") == "Evelyn"
    assert normalize_latex(r"\$ 5\%") == "5"
    assert normalize_latex(r"90^{\circ}") == "90"


# ------------------------------------------------------------------------------------------- number


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        ("#### 1,000", "1000"),
        ("#### 1000", "1,000"),
        ("The answer is $18.", "18"),
        ("The answer is 18 dollars.", "18"),
        ("Answer: 18.00", "18"),
        (r"\boxed{\$1{,}234}", "1234"),
        (r"\boxed{1\,234}", "1,234"),
        ("#### $118 000", "118000"),
        ("#### 50%", "50"),
        ("#### -3", "-3"),
        ("#### \u22123", "-3"),
        (r"\boxed{\frac{7}{2}}", "3.5"),
        ("#### 7/2", "3.5"),
        ("#### x = 5", "5"),
        ("#### 0.1", ".1"),
        ("#### 1000000.0000001", "1000000"),  # within rel tol 1e-6
    ],
)
def test_number_accepts(completion: str, reference: str) -> None:
    assert grade(completion, reference, "number") == 1.0


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        ("#### 17", "18"),
        ("#### 18 apples and 3 pears", "18"),
        ("#### about 18", "18"),
        ("#### 1,00", "100"),  # malformed thousands separator
        ("#### 18.01", "18"),
        ("#### eighteen", "18"),
        ("She had 18 eggs.", "18"),  # no final-answer statement
    ],
)
def test_number_rejects(completion: str, reference: str) -> None:
    assert grade(completion, reference, "number") == 0.0


def test_parse_number() -> None:
    assert parse_number("1,234.5") == 1234.5
    assert parse_number("5 km/h") == 5.0
    assert parse_number(r"-\frac{1}{4}") == -0.25
    assert parse_number("1/0") is None
    assert parse_number("3 4") is None
    assert parse_number("") is None


# ------------------------------------------------------------------------------------- choice, exact


@pytest.mark.parametrize(
    ("answer", "letter"),
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B)", "B"),
        ("B. the cat", "B"),
        ("b: the cat", "B"),
        (r"\text{B}", "B"),
        (r"\textbf{(B)}", "B"),
        ("(b) dogs", "B"),
        ("Option J", "J"),
        ("I think B", None),
        ("All of them", None),
        ("K", None),
        ("", None),
    ],
)
def test_choice_letter(answer: str, letter: str | None) -> None:
    assert choice_letter(answer) == letter


def test_choice_grade() -> None:
    assert grade(r"\boxed{(B)}", "B", "choice") == 1.0
    assert grade("Answer: b) dogs", "(B)", "choice") == 1.0
    assert grade(r"\boxed{\text{C}}", "b", "choice") == 0.0
    assert grade("The answer is I think B", "B", "choice") == 0.0


def test_exact_grade() -> None:
    assert grade("<answer>  Hello   World </answer>", "hello world", "exact") == 1.0
    assert grade(r"\boxed{\text{Yes}}", "yes", "exact") == 1.0
    assert grade("<answer>[1, 2, 3]</answer>", "[1, 2, 3]", "exact") == 1.0
    assert grade("<answer>[1,2,3]</answer>", "[1, 2, 3]", "exact") == 0.0
    assert grade("<answer>no</answer>", "yes", "exact") == 0.0


# ------------------------------------------------------------------------------------------ contract


def test_reward_kinds() -> None:
    assert REWARD_KINDS == ("math", "number", "last_number", "choice", "exact")


def test_unknown_kind_lists_kinds() -> None:
    with pytest.raises(ValueError, match="math, number, last_number, choice, exact"):
        grade(r"\boxed{1}", "1", "fuzzy")


@pytest.mark.parametrize(("completion", "reference", "name"), [(None, "1", "completion"), ("x", 1, "reference")])
def test_non_string_inputs(completion: object, reference: object, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        grade(completion, reference, "math")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="completion"):
        extract_answer(123)  # type: ignore[arg-type]


def test_invalid_reference_for_kind() -> None:
    with pytest.raises(ValueError, match="not a number"):
        grade("#### 3", "three", "number")
    with pytest.raises(ValueError, match="not a number"):
        grade("no answer here", "three", "number")
    with pytest.raises(ValueError, match="choice letter"):
        grade("Answer: B", "Z", "choice")


@pytest.mark.parametrize("kind", REWARD_KINDS)
def test_grade_is_zero_or_one(kind: str) -> None:
    ref = {"math": "2", "number": "2", "last_number": "2", "choice": "B", "exact": "2"}[kind]
    for completion in ("", "#### 2", r"\boxed{2}", r"\boxed{B}", "<answer>3</answer>"):
        assert grade(completion, ref, kind) in (0.0, 1.0)


def test_grade_answer_skips_extraction() -> None:
    assert grade_answer(r"\frac{1}{2}", "0.5", "math") == 1.0
    assert grade_answer("1,000", "1000", "number") == 1.0


def test_math_grade_works_off_the_main_thread() -> None:
    """math-verify's signal-based timeouts are disabled, so symbolic grading runs in worker threads."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        out = list(pool.map(lambda a: grade(f"\\boxed{{{a}}}", r"\frac{1}{2}", "math"), ["0.5", "2/4", "0.4"]))
    assert out == [1.0, 1.0, 0.0]


# --- last_number (the permissive kind) -------------------------------------------------------------------

@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("8", "8"),
        ("7 + 1 = 8", "8"),
        ("The sum is 8.", "8"),
        (r"so \boxed{12} and then 3", "3"),  # the last number wins, even after a box
        ("x = -3", "-3"),
        ("5-3", "3"),  # a minus after a digit is a subtraction, not a sign
        ("It costs 1,234 dollars", "1,234"),
        ("1,23", "23"),  # malformed thousands groups are two numbers
        ("pi is about 3.14", "3.14"),
        ("\u22127", "-7"),  # unicode minus
        ("The probability is .5", ".5"),  # a bare decimal point: was read as 5
        ("so x = -.25.", "-.25"),  # was 25: sign and point lost
        ("done in step2", None),  # digits inside a word are not a number (was 2)
        ("8 moles of H2O", "8"),  # was 2
        ("The answer is 8 (see eq2).", "8"),
        ("So it is 7/2.", "7/2"),  # one fraction, not 2
        (r"\boxed{\frac{7}{2}}", r"\frac{7}{2}"),  # was 2, which `number` grades 3.5
        (r"\boxed{-\dfrac{1}{4}}", r"-\dfrac{1}{4}"),
        (r"\boxed{1{,}234}", "1{,}234"),  # was 234
        ("version 1.2.3", "1.2"),  # a dotted run ends at its first decimal
        ("It costs $12, or 8%.", "8"),
        ("8 cm", "8"),  # a unit after the number is fine
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_last_number(completion: str, expected: str | None) -> None:
    from meshrl.rewards.extract import extract_last_number

    assert extract_last_number(completion) == expected


def test_last_number_scores_bare_answers_that_number_refuses() -> None:
    # The cases: a bare "8" and "7 + 1 = 8" score 0 under the strict kind, 1 under last_number.
    for completion in ("8", "7 + 1 = 8"):
        assert grade(completion, "8", "number") == 0.0
        assert grade(completion, "8", "last_number") == 1.0
    assert grade("1,000", "1000", "last_number") == 1.0
    # Answers the strict kind grades right are graded right by the permissive one too (they scored 0).
    for completion, ref in [(r"\boxed{\frac{7}{2}}", "3.5"), (r"\boxed{1{,}234}", "1234"), ("#### 7/2", "3.5"),
                            (r"\boxed{1\,234}", "1234"), (r"\boxed{-\frac{1}{4}}", "-0.25")]:
        assert grade(completion, ref, "number") == 1.0 == grade(completion, ref, "last_number"), completion
    assert grade("The probability is .5", "0.5", "last_number") == 1.0
    assert grade("so x = -.25", "-0.25", "last_number") == 1.0
    assert grade("The probability is .5", "5", "last_number") == 0.0
    assert grade("The answer is 8 because 5 + 3", "8", "last_number") == 0.0  # last number is 3


def test_last_number_known_weakness_rewards_a_restated_question() -> None:
    # What is 3 + 5? restated with a trailing number equal to the answer: rewarded (documented weakness).
    assert grade("What is 3 + 5? Let me see, 5 + 3 and 8", "8", "last_number") == 1.0
    assert grade("What is 3 + 5? Let me see, 5 + 3 and 8", "8", "number") == 0.0


def test_last_number_reference_must_be_a_finite_number() -> None:
    from meshrl.rewards.grading import check_reference

    with pytest.raises(ValueError, match="not a number"):
        grade("8", "eight", "last_number")
    assert check_reference("nan", "last_number") and check_reference("inf", "number")
    assert check_reference("8", "last_number") is None and check_reference("Z", "choice")
