"""Reference acceptance: does ``meshrl.rewards.grade`` accept the benchmarks' own reference solutions?

Checks (each grade runs under :class:`meshrl.rewards.RewardRunner`, 5 s timeout):

- ``math500``: each row's ``solution`` (its final answer is its last ``\\boxed{}``) against its ``answer``,
  kind ``math``, through the full ``grade`` path.
- ``math500-symbolic``: the same extracted answers through the math-verify step alone
  (:func:`meshrl.rewards.symbolic_equal`), i.e. without the normalised-string shortcut.
- ``math500-negative``: each solution against the NEXT row's answer; every accepted pair is a false
  positive unless the two references are the same answer (identical after normalisation, or listed in
  :data:`EQUIVALENT_REFERENCES`).
- ``gsm8k``: the shipped GSM8K ``solution`` texts do not contain the original ``#### N`` line (its number
  is the row's ``answer``), so the final number of a solution is taken as the last number in it (after
  removing the ``<<a=b>>`` calculator annotations) and graded, written as ``#### N`` after the
  solution, against ``answer`` with kind ``number``.
- ``gsm8k-original``: the original GSM8K format, the solution followed by ``#### <answer>``.

Prints per check the acceptance rate, errors/timeouts, the grading time per item and every miss.
Usage: ``python benchmarks/reference_acceptance.py [--data-dir DIR] [--limit N]``; the data directory
defaults to ``$MESHRL_DATA_DIR``, else ``<repo root>/../shared/data``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshrl.rewards import RewardRunner, extract_answer, grade, normalize_latex, symbolic_equal

MATH500 = "math500.jsonl"
GSM8K = "gsm8k_test.jsonl"

#: Pairs of MATH-500 ids whose different-looking references denote the same answer (negative control).
EQUIVALENT_REFERENCES: dict[frozenset[str], str] = {
    frozenset({"math500-022", "math500-023"}): "'5' and 'x=5': math-verify accepts a value for x=value",
}

_ANNOTATION = re.compile(r"<<[^>]*>>")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d{1,3}(?: \d{3})+(?:\.\d+)?|-?\d*\.?\d+")


@dataclass
class Acceptance:
    """Result of one check: counts, misses (id, extracted answer, reference), per-item seconds."""

    name: str
    n: int = 0
    accepted: int = 0
    misses: list[tuple[str, str | None, str]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.accepted / self.n if self.n else 0.0


def default_data_dir() -> Path:
    """``$MESHRL_DATA_DIR`` if set, else ``<repo root>/../shared/data``."""
    env = os.environ.get("MESHRL_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


def load_rows(path: Path, limit: int | None = None) -> list[dict]:
    """The JSON objects of a JSONL file (the first ``limit`` rows if given)."""
    rows: list[dict] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


def gsm8k_final_number(solution: str) -> str | None:
    """The last number of a GSM8K solution once its ``<<a=b>>`` calculator annotations are removed."""
    nums = _NUMBER.findall(_ANNOTATION.sub("", solution))
    return nums[-1] if nums else None


def gsm8k_completion(row: dict) -> str:
    """The solution with its final number stated GSM8K-style (``#### N``); no number: the bare solution."""
    final = gsm8k_final_number(row["solution"])
    return row["solution"] if final is None else f"{row['solution']}\n#### {final}"


def run_check(
    name: str,
    rows: list[dict],
    accept: Callable[[dict], float],
    answer_of: Callable[[dict], str | None],
    timeout_s: float = 5.0,
) -> Acceptance:
    """Apply ``accept(row) -> reward`` to every row under a RewardRunner; collect rate, misses, timings."""
    runner = RewardRunner(lambda _text, row: accept(row), timeout_s=timeout_s)
    res = Acceptance(name=name)
    for row in rows:
        t0 = time.perf_counter()
        (score,) = runner([""], [row])
        res.seconds.append(time.perf_counter() - t0)
        res.n += 1
        if score == 1.0:
            res.accepted += 1
        else:
            res.misses.append((row["id"], answer_of(row), row["answer"]))
    res.stats = runner.pop_stats()
    return res


def math500_checks(rows: list[dict]) -> list[Acceptance]:
    """The ``math500``, ``math500-symbolic`` and ``math500-negative`` checks (see the module docstring)."""
    boxed = {r["id"]: extract_answer(r["solution"]) for r in rows}
    out = [
        run_check("math500", rows, lambda r: grade(r["solution"], r["answer"], "math"), lambda r: boxed[r["id"]]),
        run_check(
            "math500-symbolic",
            rows,
            lambda r: float(boxed[r["id"]] is not None and symbolic_equal(boxed[r["id"]], r["answer"])),
            lambda r: boxed[r["id"]],
        ),
    ]
    # Negative control: pair each solution with the next row's reference; a "miss" here is a false positive.
    pairs = [
        {"id": f"{a['id']}~{b['id']}", "solution": a["solution"], "answer": b["answer"], "other": a["answer"]}
        for a, b in zip(rows, rows[1:] + rows[:1], strict=True)
    ]

    def rejects(p: dict) -> float:
        same = normalize_latex(p["other"]) == normalize_latex(p["answer"]) or (
            frozenset(p["id"].split("~")) in EQUIVALENT_REFERENCES
        )
        return float(same or grade(p["solution"], p["answer"], "math") == 0.0)

    out.append(run_check("math500-negative", pairs, rejects, lambda p: boxed[p["id"].split("~")[0]]))
    return out


def gsm8k_checks(rows: list[dict]) -> list[Acceptance]:
    """The ``gsm8k`` (final number of the solution) and ``gsm8k-original`` checks."""
    return [
        run_check(
            "gsm8k",
            rows,
            lambda r: grade(gsm8k_completion(r), r["answer"], "number"),
            lambda r: gsm8k_final_number(r["solution"]),
        ),
        run_check(
            "gsm8k-original",
            rows,
            lambda r: grade(f"{r['solution']}\n#### {r['answer']}", r["answer"], "number"),
            lambda r: r["answer"],
        ),
    ]


def report(res: Acceptance, out=sys.stdout) -> None:
    """Print one check's summary line and its misses."""
    mean_ms = 1e3 * sum(res.seconds) / max(len(res.seconds), 1)
    max_ms = 1e3 * max(res.seconds, default=0.0)
    print(
        f"{res.name}: accepted {res.accepted}/{res.n} = {100 * res.rate:.2f}%  "
        f"errors={res.stats.get('reward/errors', 0)} timeouts={res.stats.get('reward/timeouts', 0)}  "
        f"time/item mean {mean_ms:.2f} ms, max {max_ms:.1f} ms, total {sum(res.seconds):.2f} s",
        file=out,
    )
    for rid, got, want in res.misses:
        print(f"  MISS {rid}: extracted {got!r} vs answer {want!r}", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Reference acceptance of meshrl.rewards.grade")
    ap.add_argument("--data-dir", type=Path, default=default_data_dir())
    ap.add_argument("--limit", type=int, default=None, help="rows per file (default: all)")
    args = ap.parse_args(argv)
    status = 0
    for fname, checks in ((MATH500, math500_checks), (GSM8K, gsm8k_checks)):
        path = args.data_dir / fname
        if not path.exists():
            print(f"{fname}: missing under {args.data_dir} (set MESHRL_DATA_DIR)", file=sys.stderr)
            status = 1
            continue
        for res in checks(load_rows(path, args.limit)):
            report(res)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
