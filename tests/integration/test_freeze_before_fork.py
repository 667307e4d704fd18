"""freeze_objects_before_fork keeps the parent's garbage collector from turning a forked child's inherited heap
into private copies (memory counted once per process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs fork and /proc")

# 400k small container objects (~60 MB of heap), a child forked beside them, then collections in the parent: the
# child's private pages after the parent's collections, in kB.
PROGRAM = """
import gc, os, re, sys, time
from meshrl.forkpool import freeze_objects_before_fork

objects = [[i, str(i)] for i in range(400_000)]
if sys.argv[1] == "freeze":
    freeze_objects_before_fork()
pid = os.fork()
if pid == 0:
    time.sleep(30)
    os._exit(0)
for _ in range(3):
    gc.collect()
time.sleep(0.2)
rollup = open(f"/proc/{pid}/smaps_rollup").read()
private = sum(int(v) for v in re.findall(r"Private_(?:Clean|Dirty):\\s+(\\d+)", rollup))
os.kill(pid, 9)
print(private)
"""


def _child_private_kb(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True,
                         timeout=120)
    return int(out.stdout.split()[-1])


def test_frozen_objects_stay_shared_with_a_forked_child() -> None:
    plain, frozen = _child_private_kb("plain"), _child_private_kb("freeze")
    assert plain > 20 * 1024, plain  # the parent's collections copied most of the objects' pages
    assert frozen < plain / 3, (frozen, plain)
