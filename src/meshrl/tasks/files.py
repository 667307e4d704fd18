"""File-backed tasks: ``jsonl:PATH``, ``parquet:PATH`` and the ``math500`` / ``gsm8k`` shortcuts.

Options (keyword arguments of :func:`~meshrl.tasks.load_task` or query keys of the spec):

==================  ==============  ===========================================================
option              query alias     meaning
==================  ==============  ===========================================================
``problem_field``   ``problem``     column holding the question (default ``problem``)
``answer_field``    ``answer``      column holding the reference answer (default ``answer``)
``id_field``        ``id``          column holding a unique id (default ``id``; optional: when
                                    the column is absent, ids are the 0-based row index)
``kind``                            reward kind: ``math`` | ``number`` | ``last_number`` |
                                    ``choice`` | ``exact`` (default ``exact``)
``eval_fraction``                   fraction of rows held out as the ``eval`` split (default 0)
``limit``                           use only the first ``limit`` rows (before splitting)
``instruction``                     answer-format instruction (default: the kind's, see
                                    :data:`~meshrl.tasks.base.DEFAULT_INSTRUCTIONS`; empty = none)
==================  ==============  ===========================================================

Every row is validated when the task is loaded, so a bad file fails before training starts: bad
JSON, bytes that are not UTF-8, a missing field, an empty / non-string / non-finite (``NaN``) problem
or answer, or a reference the kind can never match (``number``: not a finite number; ``choice``: not a
letter) raise ``ValueError`` naming the file, the 1-based line (row) and the field.  Numeric answers are
converted to strings.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from meshrl.errors import MissingDependency
from meshrl.tasks._spec import held_out_split
from meshrl.tasks.base import (
    DEFAULT_INSTRUCTIONS,
    Problem,
    StaticTask,
    register_task,
    register_task_prefix,
    take_options,
)

FILE_KINDS = ("math", "number", "last_number", "choice", "exact")
KIND_DEFAULT = "<the reward kind's default>"  # the instruction option's default: DEFAULT_INSTRUCTIONS[kind]
_ALIASES = {"problem": "problem_field", "answer": "answer_field", "id": "id_field"}
_DEFAULTS: dict[str, Any] = {
    "problem_field": "problem",
    "answer_field": "answer",
    "id_field": "id",
    "kind": "exact",
    "eval_fraction": 0.0,
    "limit": None,
    "instruction": KIND_DEFAULT,
}


class FileTask(StaticTask):
    """A task read from a JSONL or Parquet file (see the module docstring for the options)."""

    def __init__(self, name: str, path: Path, problems: list[Problem], options: dict[str, Any], seed: int):
        self.path = path
        self.eval_fraction = float(options["eval_fraction"])
        train, held = held_out_split(problems, self.eval_fraction, seed)
        splits = {"train": train, "eval": held} if self.eval_fraction > 0 else {"train": train}
        splits["all"] = problems
        super().__init__(name, splits, reward_kind=options["kind"], instruction=options["instruction"])

    def _missing_split_message(self, split: str) -> str:
        message = super()._missing_split_message(split)
        if split == "eval":
            message += " (load with eval_fraction>0 for a held-out split, or use split='all')"
        return message


def _resolve_options(name: str, options: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    renamed = {_ALIASES.get(key, key): value for key, value in options.items()}
    opts = take_options(name, renamed, defaults)
    for key in ("problem_field", "answer_field", "id_field"):
        opts[key] = str(opts[key])
    if opts["kind"] not in FILE_KINDS:
        raise ValueError(f"task {name!r}: kind must be one of {FILE_KINDS}, got {opts['kind']!r}")
    if opts["limit"] is not None and (not isinstance(opts["limit"], int) or opts["limit"] < 1):
        raise ValueError(f"task {name!r}: limit must be a positive integer, got {opts['limit']!r}")
    if opts["instruction"] == KIND_DEFAULT:
        opts["instruction"] = DEFAULT_INSTRUCTIONS[opts["kind"]]
    elif opts["instruction"] is not None and not isinstance(opts["instruction"], str):
        raise ValueError(f"task {name!r}: instruction must be text, got {opts['instruction']!r}")
    return opts


def _field_text(value: Any, where: str, field: str, *, required: bool = True) -> str:
    """Validate one cell: strings must be non-empty after stripping; ints/floats become strings."""
    if value is None:
        raise ValueError(f"{where}: field {field!r} is missing (null)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: field {field!r} is {value!r}, not a finite number (JSON NaN / Infinity)")
    text = value if isinstance(value, str) else str(value)
    if not text.strip():
        raise ValueError(f"{where}: field {field!r} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON allows "\ud800"; no tokenizer (nor a UTF-8 record) takes it
        raise ValueError(f"{where}: field {field!r} holds a lone surrogate {text[e.start]!r} at character {e.start} "
                         "(an unpaired \\uD800-\\uDFFF escape), which is not text") from None
    return text


def _row_problem(row: Any, index: int, where: str, opts: dict[str, Any]) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    fields = {"problem": opts["problem_field"], "answer": opts["answer_field"]}
    for field in fields.values():
        if field not in row:
            raise ValueError(f"{where}: missing field {field!r} (fields present: {sorted(row)})")
    prompt = _field_text(row[fields["problem"]], where, fields["problem"])
    answer = _field_text(row[fields["answer"]], where, fields["answer"])
    check_answer(answer, opts["kind"], where, fields["answer"])
    id_field = opts["id_field"]
    has_id = id_field in row and row[id_field] is not None
    pid = _field_text(row[id_field], where, id_field) if has_id else str(index)
    used = {fields["problem"], fields["answer"], id_field}
    meta = {k: v for k, v in row.items() if k not in used}
    meta["row"] = index
    return Problem(id=pid, prompt=prompt, answer=answer.strip(), meta=meta)


def check_answer(answer: str, kind: str, where: str, field: str) -> None:
    """Refuse a reference answer that ``kind`` can never match (``NaN`` for ``number``, ``7`` for ``choice``)."""
    from meshrl.rewards.grading import check_reference

    why = check_reference(answer.strip(), kind)
    if why:
        raise ValueError(f"{where}: field {field!r} {why}")


def decoded_lines(path: Path, lines: Iterable[bytes]) -> Iterator[tuple[int, str]]:
    """``(1-based line number, text)`` of UTF-8 byte lines; a byte-order mark on line 1 is dropped and bytes
    that are not UTF-8 raise ``ValueError`` naming the file, the line and the byte offset in it."""
    for lineno, raw in enumerate(lines, start=1):
        try:
            yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}, line {lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                             f"{exc.start} of the line); re-encode the file as UTF-8") from None


def parse_jsonl_line(path: Path, lineno: int, line: str) -> Any:
    """One JSON value; malformed JSON raises ``ValueError`` naming the file and the line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}, line {lineno}: malformed JSON ({exc.msg})") from None
    except RecursionError:
        raise ValueError(f"{path}, line {lineno}: JSON nested too deeply") from None


def _iter_jsonl(path: Path):
    """Yield ``(line_number, row)`` for each non-blank line; bad JSON or bytes raise ``ValueError``."""
    with path.open("rb") as handle:
        for lineno, line in decoded_lines(path, handle):
            if line.strip():
                yield lineno, parse_jsonl_line(path, lineno, line)


def _iter_parquet(path: Path):
    """Yield ``(row_number, row)`` (1-based) for each row of a Parquet file."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency("parquet tasks need pyarrow: pip install 'meshrl[tasks]'") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated exception types
        raise ValueError(f"{path}: cannot read Parquet file ({exc})") from exc
    yield from enumerate(table.to_pylist(), start=1)


def _read_problems(path: Path, fmt: str, opts: dict[str, Any]) -> list[Problem]:
    if not path.is_file():
        raise ValueError(f"task file not found: {path}")
    rows = _iter_jsonl(path) if fmt == "jsonl" else _iter_parquet(path)
    unit = "line" if fmt == "jsonl" else "row"
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for number, row in rows:
        where = f"{path}, {unit} {number}"
        problem = _row_problem(row, len(problems), where, opts)
        if problem.id in seen:
            raise ValueError(
                f"{where}: field {opts['id_field']!r} repeats id {problem.id!r} "
                f"(first seen at {unit} {seen[problem.id]})"
            )
        seen[problem.id] = number
        problems.append(problem)
    if not problems:
        raise ValueError(f"{path}: no problems (the file has no rows)")
    return problems[: opts["limit"]] if opts["limit"] else problems


def load_file_task(
    path: str | Path, fmt: str, *, seed: int = 0, name: str | None = None, **options: Any
) -> FileTask:
    """Load and validate a JSONL (``fmt="jsonl"``) or Parquet (``fmt="parquet"``) task file."""
    path = Path(path).expanduser()
    name = name or f"{fmt}:{path}"
    opts = _resolve_options(name, options, _DEFAULTS)
    problems = _read_problems(path, fmt, opts)
    return FileTask(name, path, problems, opts, seed)


@register_task_prefix("jsonl", "jsonl:PATH")
def _jsonl_task(path: str, *, seed: int = 0, **options: Any) -> FileTask:
    return load_file_task(path, "jsonl", seed=seed, **options)


@register_task_prefix("parquet", "parquet:PATH")
def _parquet_task(path: str, *, seed: int = 0, **options: Any) -> FileTask:
    return load_file_task(path, "parquet", seed=seed, **options)


def _candidate_data_dirs() -> list[Path]:
    repo_root = Path(__file__).resolve().parents[3]
    return [repo_root / "shared" / "data", repo_root.parent / "shared" / "data"]


def data_dir() -> Path:
    """The shared evaluation-data directory.

    ``$MESHRL_DATA_DIR`` when set (it must exist), else the first existing of
    ``<repo root>/shared/data`` and ``<repo root>/../shared/data``.  Raises ``FileNotFoundError``
    saying where it looked.
    """
    env = os.environ.get("MESHRL_DATA_DIR")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"MESHRL_DATA_DIR={env!r} is not a directory")
        return path
    candidates = _candidate_data_dirs()
    for path in candidates:
        if path.is_dir():
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(f"shared data directory not found; set MESHRL_DATA_DIR (looked in: {looked})")


def _benchmark(name: str, filename: str, kind: str, seed: int, options: dict[str, Any]) -> FileTask:
    path = data_dir() / filename
    if not path.is_file():
        raise FileNotFoundError(f"task {name!r}: data file {path} not found")
    if "kind" in options and options["kind"] != kind:
        raise ValueError(f"task {name!r} always grades with kind {kind!r}")
    options = {**options, "kind": kind}
    return load_file_task(path, "jsonl", seed=seed, name=name, **options)


@register_task("math500")
def math500(*, seed: int = 0, **options: Any) -> FileTask:
    """MATH-500 (500 problems, LaTeX answers, graded with kind ``math``)."""
    return _benchmark("math500", "math500.jsonl", "math", seed, options)


@register_task("gsm8k")
def gsm8k(*, seed: int = 0, **options: Any) -> FileTask:
    """GSM8K test split (1319 problems, numeric answers, graded with kind ``number``)."""
    return _benchmark("gsm8k", "gsm8k_test.jsonl", "number", seed, options)
