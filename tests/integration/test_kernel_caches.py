"""meshrl bounds oneDNN's kernel caches (meshrl.kernel_caches): by its entry points, never on import, the user's own
values kept, RSS bounded over many matmul shapes, and a rebuilt kernel computes the same values."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshrl.kernel_caches import CACHE_VARIABLES, KERNEL_CACHE_ENTRIES, bound_kernel_caches

GROWTH = """
import re, sys, torch
from meshrl.kernel_caches import bound_kernel_caches
if sys.argv[1:] == ["bound"]:
    bound_kernel_caches()  # what a Python-API user does, before the first matmul
torch.set_num_threads(1)
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
w = torch.randn(1536, 576, dtype=torch.bfloat16)
for m in range(1, 9):
    torch.nn.functional.linear(torch.randn(m, 576, dtype=torch.bfloat16), w)
start = rss()
for m in range(9, 409):  # 400 shapes, each a kernel of its own
    torch.nn.functional.linear(torch.randn(m, 576, dtype=torch.bfloat16), w)
print(rss() - start)
"""


def _env(**caches: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    env.update(caches)
    return env


def _run(code: str, env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_bound_sets_only_what_the_environment_leaves_unset(monkeypatch):
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    assert bound_kernel_caches(64) == {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    with pytest.raises(ValueError, match="entries must be >= 1"):
        bound_kernel_caches(0)


def test_importing_meshrl_changes_no_environment_and_builds_no_kernel():
    """A library leaves its host's environment alone: verl imports meshrl's plug-in in every process, TRL scripts
    import its callbacks. Importing the command line builds no oneDNN kernel either, so ``main`` bounding the caches
    first is in time (``ONEDNN_VERBOSE`` prints a line once oneDNN builds anything)."""
    code = f"import os, meshrl, meshrl.cli; print(*(name in os.environ for name in {CACHE_VARIABLES!r}))"
    printed = _run(code, _env(ONEDNN_VERBOSE="1"))
    assert printed == "False False", printed


def _entry_points() -> dict[str, object]:
    from experiments.collapse_testbed.cli import main as collapse_testbed
    from experiments.health_corpus.cli import main as health_corpus
    from experiments.tools_testbed.cli import main as tools_testbed

    from meshrl.cli import main as meshrl_cli

    return {"meshrl": meshrl_cli, "collapse_testbed": collapse_testbed, "health_corpus": health_corpus,
            "tools_testbed": tools_testbed}


@pytest.mark.parametrize("entry", ["meshrl", "collapse_testbed", "health_corpus", "tools_testbed"])
def test_entry_points_bound_both_caches_unless_the_user_set_them(entry, monkeypatch, capsys):
    main = _entry_points()[entry]
    for name in CACHE_VARIABLES:
        monkeypatch.setenv(name, "")  # recorded, so that the test's end restores the variable's absence
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as done:  # --help: the bound comes first, before the arguments are parsed
        main(["--help"])
    assert done.value.code == 0
    assert {name: os.environ[name] for name in CACHE_VARIABLES} == dict.fromkeys(CACHE_VARIABLES,
                                                                                  str(KERNEL_CACHE_ENTRIES))
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_ENTRIES)


def test_the_bound_keeps_memory_flat_over_many_shapes():
    torch_sizes = float(_run(GROWTH, _env(LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")))
    if torch_sizes < 60:
        pytest.skip(f"bf16 matmuls here do not cache oneDNN kernels (+{torch_sizes:.0f} MB over 400 shapes)")
    bounded = float(_run(GROWTH, _env(), "bound"))
    # measured: +276 MB with PyTorch's sizes, +117 MB with meshrl's 128 entries, +19 MB with 16 (AMD EPYC, AVX-512);
    # +285 MB against +205 MB on an Intel Xeon with AMX, where oneDNN keeps more per shape than its primitive cache
    assert bounded < 0.8 * torch_sizes, (bounded, torch_sizes)


def test_a_rebuilt_kernel_computes_the_same_values():
    """The same bf16 products, bit for bit, from a process whose caches hold one kernel (every call rebuilds) and
    from one with PyTorch's sizes."""
    code = """
import hashlib, torch
torch.manual_seed(0)
w = torch.randn(1536, 576, dtype=torch.bfloat16)
xs = [torch.randn(m, 576, dtype=torch.bfloat16) for m in (3, 17, 64, 3, 17)]
outs = [torch.nn.functional.linear(x, w) for x in xs]
print(hashlib.sha256(b"".join(o.view(torch.int16).numpy().tobytes() for o in outs)).hexdigest())
"""
    rebuilt = _run(code, _env(LRU_CACHE_CAPACITY="1", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1"))
    cached = _run(code, _env(LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024"))
    assert rebuilt == cached
