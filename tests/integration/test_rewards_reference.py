"""Reference acceptance on real data: the grader must accept MATH-500's and GSM8K's own solutions.

Grades both files IN FULL with the checks of ``benchmarks/reference_acceptance.py`` (see its docstring)
and asserts the measured rates. Every miss is either a grader bug (the test fails) or listed in an
allow-list below with the reason the reference itself is ambiguous; a listed id that stops missing
fails the test too, so the lists stay exact. Data: ``$MESHRL_DATA_DIR`` else ``<repo>/../shared/data``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "reference_acceptance.py"
_spec = importlib.util.spec_from_file_location("reference_acceptance", _BENCH)
assert _spec is not None and _spec.loader is not None
ra = importlib.util.module_from_spec(_spec)
sys.modules["reference_acceptance"] = ra
_spec.loader.exec_module(ra)

# Measured on the shipped files: math500 500/500, math500-symbolic 500/500, math500-negative
# 500/500, gsm8k 1284/1319 (the 35 misses below), gsm8k-original 1319/1319.
FLOORS = {
    "math500": 1.0,
    "math500-symbolic": 0.99,
    "math500-negative": 1.0,
    "gsm8k": 0.97,
    "gsm8k-original": 1.0,
}

_RESTATE = "the solution's last number restates a quantity of the question after the answer"
_CENTS = "the answer is asked in cents; the solution's last number is in dollars"
# fmt: off
_RESTATED = [
    "0020", "0035", "0147", "0287", "0308", "0309", "0324", "0439", "0451", "0538", "0574", "0601",
    "0605", "0623", "0638", "0645", "0669", "0674", "0760", "0814", "0853", "1051", "1085", "1117",
    "1221", "1300", "1314",
]
# fmt: on
#: GSM8K rows whose *last number* is not their answer (check "gsm8k"), with the reason. Each was read.
GSM8K_AMBIGUOUS: dict[str, str] = {
    **{f"gsm8k-{n}": _RESTATE for n in _RESTATED},
    "gsm8k-0493": _CENTS + " ($0.25 vs 25)",
    "gsm8k-0607": _CENTS + " ($0.10 vs 10)",
    "gsm8k-1243": _CENTS + " ($0.50 vs 50)",
    "gsm8k-0505": "ends with a comparison '1600 > 1200' after the answer 1600",
    "gsm8k-0593": "states its answer in words ('it took three days')",
    "gsm8k-0635": "states the answer (4) first, then checks it: '10 - 4 = 6'",
    "gsm8k-1001": "a clock time '2:00 pm' (answer 2); the last number is the minutes '00'",
    "gsm8k-1038": "the solution computes 6 years but the reference answer is 4 (inconsistent in GSM8K)",
}
ALLOWED: dict[str, dict[str, str]] = {"gsm8k": GSM8K_AMBIGUOUS}


def _rows(fname: str) -> list[dict]:
    path = ra.default_data_dir() / fname
    if not path.exists():
        pytest.skip(f"{path} missing: set MESHRL_DATA_DIR to the directory holding {fname}")
    return ra.load_rows(path)


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    out = {}
    for fname, checks in ((ra.MATH500, ra.math500_checks), (ra.GSM8K, ra.gsm8k_checks)):
        for res in checks(_rows(fname)):
            ra.report(res)
            out[res.name] = res
    return out


@pytest.mark.parametrize("name", list(FLOORS))
def test_reference_acceptance(results: dict, name: str, capsys: pytest.CaptureFixture) -> None:
    res = results[name]
    with capsys.disabled():
        print(f"\n{name}: {res.accepted}/{res.n} = {100 * res.rate:.2f}% ({sum(res.seconds):.2f} s)")
    expected_n = {"math500": 500, "gsm8k": 1319}[name.split("-")[0]]
    assert res.n == expected_n, f"{name}: graded {res.n} rows, the file has {expected_n}"
    assert res.stats == {"reward/errors": 0, "reward/timeouts": 0}, res.stats
    allowed = ALLOWED.get(name, {})
    missed = {rid for rid, _, _ in res.misses}
    unexplained = [m for m in res.misses if m[0] not in allowed]
    assert not unexplained, f"{name}: misses not in the allow-list (grader bug?): {unexplained}"
    stale = sorted(set(allowed) - missed)
    assert not stale, f"{name}: allow-listed ids that are now accepted (remove them): {stale}"
    assert res.rate >= FLOORS[name], f"{name}: rate {res.rate:.4f} < floor {FLOORS[name]}"
