"""Offline prefix generation with a validated, resumable JSONL cache (docs/method.md §1.3).

Cache file (``out_path``), one JSON object per line, one line per distinct problem::

    {"key": sha256 of the normalised problem, "id": the query id, "problem": ..., "m": 4,
     "prefixes": [...], "names": [...], "attempts": 1, "coach": {backend description, no key},
     "prompt_version": "meshrl-coach-v1", "created": ISO time}

Lines are appended as queries finish, so an interrupted run loses nothing and a re-run only asks the
coach about problems whose key is not in the file. ``rejects_path`` holds the problems that failed
every attempt, with the reasons of each attempt; it is rewritten at the end of a run (entries of
problems that later succeeded are dropped).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import unicodedata
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from meshrl.jsonl import iter_jsonl
from meshrl.mesh.coach.backends import BackendError, MissingKeyError, RuleCoach, describe_backend
from meshrl.mesh.coach.prompts import COACH_PROMPT_VERSION, coach_messages, retry_messages
from meshrl.mesh.coach.validate import PrefixRules, check_answer, validate_strategies

Progress = Callable[[int, int, str], None]
_KEEP_ANSWER_CHARS = 2000


def normalize_problem(problem: str) -> str:
    """Unicode NFC, surrounding whitespace removed, every whitespace run collapsed to one space.

    Case and punctuation are kept: they can change a math problem.
    """
    return " ".join(unicodedata.normalize("NFC", problem).split())


def query_key(problem_text: str) -> str:
    """Stable cache key of a problem: hex sha256 of :func:`normalize_problem` (independent of ids/order)."""
    if not isinstance(problem_text, str):
        raise ValueError(f"problem_text must be a str, got {type(problem_text).__name__}")
    return hashlib.sha256(normalize_problem(problem_text).encode("utf-8")).hexdigest()


@dataclass
class CoachSummary:
    """What one :func:`generate_prefixes` run did (counts are over distinct problems)."""

    total: int  # queries passed in
    unique: int  # distinct problems (by key)
    duplicates: int  # queries whose problem repeats an earlier one
    cached: int  # found in out_path, not regenerated
    generated: int  # accepted this run
    rejected: int  # failed every attempt this run
    requests: int  # coach calls made this run (backend-internal HTTP retries not counted)
    out_path: str
    rejects_path: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    """Records of a JSONL file; a truncated last line (interrupted write) is dropped and the file repaired."""
    if not path.is_file():
        return []
    out = []
    for n, rec in iter_jsonl(path, what=what):
        if not isinstance(rec.get("key"), str) or not rec["key"]:
            raise ValueError(f"{what} {path}, line {n}: not a record with a 'key' string (the problem's hash), "
                             f"got {_kind(rec.get('key'))}")
        if what == "prefix file":
            _check_prefix_record(rec, f"{what} {path}, line {n}")
        out.append(rec)
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # the partial last line of an interrupted append: write what is intact
        _rewrite(path, out)
    return out


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _check_prefix_record(rec: dict[str, Any], where: str) -> None:
    """``ValueError`` naming ``where`` (file and line) unless ``prefixes`` is a list of strings and ``names``,
    when given, a list of strings (the record ``generate_prefixes`` writes)."""
    for field, required in (("prefixes", True), ("names", False)):
        value = rec.get(field)
        if value is None and not required:
            continue
        if not isinstance(value, list):
            raise ValueError(f"{where}: '{field}' must be a list of strings, got {_kind(value)}")
        bad = next((i for i, item in enumerate(value) if not isinstance(item, str)), None)
        if bad is not None:
            raise ValueError(f"{where}: '{field}' item {bad} must be a string, got {_kind(value[bad])}")


def _rewrite(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, path)


def load_prefix_records(path: str | Path) -> dict[str, dict[str, Any]]:
    """All cache records of ``path`` by key (the last line wins for a repeated key)."""
    return {r["key"]: r for r in _read_jsonl(Path(path), "prefix file")}


def load_prefixes(path: str | Path) -> dict[str, list[str]]:
    """``{query_key(problem): [prefix_1, ..., prefix_m]}`` from a prefix cache written by generate_prefixes."""
    out = {}
    for key, rec in load_prefix_records(path).items():
        prefixes = rec.get("prefixes")
        if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
            raise ValueError(f"prefix file {path}: record {key[:12]} has no list of prefixes")
        out[key] = list(prefixes)
    return out


def prefixes_by_problem(path: str | Path, problems: Sequence[Any], m: int) -> tuple[dict[str, list[str]], list[str]]:
    """Each problem's first ``m`` prefixes from a prefix file, keyed by problem id (problems need ``.id`` and
    ``.prompt``), and the ids of the problems that have fewer than ``m``: ``(found, missing)``."""
    table = load_prefixes(path)
    found: dict[str, list[str]] = {}
    missing: list[str] = []
    for p in problems:
        prefixes = table.get(query_key(p.prompt))
        if prefixes is None or len(prefixes) < m:
            missing.append(p.id)
        else:
            found[p.id] = list(prefixes[:m])
    return found, missing


def _check_queries(queries: Sequence[dict[str, Any]]) -> None:
    if isinstance(queries, dict | str) or not isinstance(queries, Sequence):
        raise ValueError("queries must be a list of dicts with 'id', 'problem' and 'answer'")
    for i, q in enumerate(queries):
        if not isinstance(q, dict):
            raise ValueError(f"queries[{i}] must be a dict, got {type(q).__name__}")
        if not isinstance(q.get("problem"), str) or not q["problem"].strip():
            raise ValueError(f"queries[{i}] has no non-empty 'problem' string")
        if "answer" not in q:
            raise ValueError(f"queries[{i}] has no 'answer' (use None to skip the leak check)")


def _solve(
    query: dict[str, Any], backend: Any, rules: PrefixRules, max_attempts: int, prompt_words: int
) -> tuple[dict[str, Any] | None, list[dict[str, Any]], int]:
    """Ask the coach until an answer passes validation: ``(accepted or None, attempt log, calls)``."""
    answer = query.get("answer")
    answer = None if answer is None else str(answer)
    base = coach_messages(query["problem"], rules.m, max_words=prompt_words)
    messages = base
    history: list[dict[str, Any]] = []
    calls = 0
    for attempt in range(1, max_attempts + 1):
        text = ""
        if isinstance(backend, RuleCoach):
            proposed = backend.propose(query, rules.m)
            if proposed is None:
                history.append({"attempt": attempt, "reasons": ["rule coach has no strategies for this query"]})
                break  # deterministic: asking again gives the same answer
            strategies = [{"name": "", "prefix": " ".join(p.split())} for p in proposed]
            reasons = validate_strategies(strategies, answer, rules)
        else:
            calls += 1
            try:
                text = backend.complete(messages)
            except MissingKeyError:
                raise  # a set-up error: every other attempt would fail the same way
            except BackendError as e:
                history.append({"attempt": attempt, "reasons": [f"backend error: {e}"]})
                continue
            if not isinstance(text, str):
                text = "" if text is None else str(text)
            strategies, reasons = check_answer(text, answer, rules)
        if not reasons:
            return {"strategies": strategies, "attempts": attempt}, history, calls
        history.append({"attempt": attempt, "reasons": reasons, "answer": text[:_KEEP_ANSWER_CHARS]})
        if text:
            messages = retry_messages(base, text, reasons, rules.m)
    return None, history, calls


def generate_prefixes(
    queries: Sequence[dict[str, Any]],
    backend: Any,
    m: int = 4,
    out_path: str | Path = "prefixes.jsonl",
    rejects_path: str | Path | None = None,
    max_attempts: int = 3,
    *,
    rules: PrefixRules | None = None,
    concurrency: int | None = None,
    progress: Progress | None = None,
    prompt_words: int = 60,
) -> CoachSummary:
    """Generate, validate and cache m strategy prefixes per distinct problem; resumable.

    Args:
        queries: dicts with ``id``, ``problem`` (the question text) and ``answer`` (reference answer,
            used only for the leak check and never shown to the coach; ``None`` skips that check).
            Other fields are passed to a :class:`RuleCoach` untouched.
        backend: a :class:`ChatBackend` (``complete(messages) -> str``) or a :class:`RuleCoach`.
        m: prefixes per problem.
        out_path: the JSONL cache; problems whose key is already there are reused, not regenerated.
        rejects_path: JSONL of problems that failed every attempt, with the reasons of each attempt
            (default: ``out_path`` with suffix ``.rejects.jsonl``).
        max_attempts: coach answers tried per problem; a retry shows the coach its rejected answer and
            the reasons.
        rules: validation thresholds (``PrefixRules(m=m)`` by default; its ``m`` must equal ``m``).
        concurrency: worker threads (default ``backend.concurrency``, else 1).
        progress: ``progress(done, total, status)`` after each distinct problem, with status
            ``"cached"``, ``"ok"`` or ``"rejected"``; called from the calling thread.
        prompt_words: the word limit stated to the coach (keep it below ``rules.max_words``).
    Returns:
        :class:`CoachSummary`.
    """
    _check_queries(queries)
    rules = rules or PrefixRules(m=m)
    if rules.m != m:
        raise ValueError(f"rules.m={rules.m} differs from m={m}")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
    if not isinstance(backend, RuleCoach) and not callable(getattr(backend, "complete", None)):
        raise ValueError("backend must have complete(messages) -> str or be a RuleCoach")
    workers = concurrency if concurrency is not None else int(getattr(backend, "concurrency", 1) or 1)
    if workers < 1:
        raise ValueError(f"concurrency must be >= 1, got {workers}")
    preflight = getattr(backend, "preflight", None)
    if callable(preflight):
        preflight()  # e.g. an unset API key variable: fail before any query is tried
    out = Path(out_path)
    rej = Path(rejects_path) if rejects_path is not None else out.with_name(out.stem + ".rejects.jsonl")

    cache = load_prefix_records(out)
    wrong_m = sorted({len(r.get("prefixes", [])) for r in cache.values()} - {m})
    if wrong_m:
        raise ValueError(f"out_path {out} holds prefixes for m={wrong_m}, not m={m}; use another out_path")
    todo: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    duplicates = 0
    for q in queries:
        key = query_key(q["problem"])
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        if key not in cache:
            todo[key] = q
    total = len(seen)
    done = cached = total - len(todo)
    if progress:
        for i in range(1, cached + 1):
            progress(i, total, "cached")

    coach = describe_backend(backend)
    new_rejects: dict[str, dict[str, Any]] = {}
    generated = requests = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as f, ThreadPoolExecutor(max_workers=workers) as pool:
        futures: dict[Future, str] = {
            pool.submit(_solve, q, backend, rules, max_attempts, prompt_words): key for key, q in todo.items()
        }
        pending = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    key = futures[fut]
                    q = todo[key]
                    accepted, history, calls = fut.result()
                    requests += calls
                    base = {"key": key, "id": q.get("id"), "problem": q["problem"]}
                    if accepted is not None:
                        strategies = accepted["strategies"]
                        rec = {
                            **base,
                            "m": m,
                            "prefixes": [s["prefix"] for s in strategies],
                            "names": [s.get("name", "") for s in strategies],
                            "attempts": accepted["attempts"],
                            "coach": coach,
                            "prompt_version": COACH_PROMPT_VERSION,
                            "created": datetime.now(UTC).isoformat(timespec="seconds"),
                        }
                        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                        f.flush()
                        generated += 1
                        status = "ok"
                    else:
                        last = history[-1]["reasons"] if history else ["no attempt made"]
                        new_rejects[key] = {**base, "attempts": len(history), "reasons": last, "history": history}
                        status = "rejected"
                    done += 1
                    if progress:
                        progress(done, total, status)
        finally:
            for fut in pending:
                fut.cancel()

    # Rejects file = problems that are still rejected: earlier entries not retried now, plus this run's.
    kept = [r for r in _read_jsonl(rej, "rejects file") if r["key"] not in todo and r["key"] not in cache]
    _rewrite(rej, kept + list(new_rejects.values()))
    return CoachSummary(
        total=len(queries),
        unique=total,
        duplicates=duplicates,
        cached=cached,
        generated=generated,
        rejected=len(new_rejects),
        requests=requests,
        out_path=str(out),
        rejects_path=str(rej),
    )
