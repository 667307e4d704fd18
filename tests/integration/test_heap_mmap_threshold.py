"""set_heap_mmap_threshold: freed large blocks leave the process instead of staying in glibc's heap."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshrl.forkpool import _malloc_trim

pytestmark = pytest.mark.skipif(_malloc_trim() is None or not sys.platform.startswith("linux"),
                                reason="needs glibc and /proc")

# One 8 MiB block freed first raises glibc's dynamic threshold to 8 MiB; then 200 blocks of 1 MiB, each followed
# by a small block that stays alive (so the freed 1 MiB blocks are holes, not the top of the heap); free the 1 MiB
# blocks and report the resident memory they leave behind, in MiB.
PROGRAM = """
import re, sys
from meshrl.forkpool import set_heap_mmap_threshold

def rss_mib():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024

applied = set_heap_mmap_threshold(int(sys.argv[1]))
big = bytearray(8 << 20)
del big
before = rss_mib()
blocks, pins = [], []
for i in range(200):
    blocks.append(bytearray(b"x") * (1 << 20))
    pins.append(bytearray(b"y") * 512)
del blocks
print(applied, rss_mib() - before)
"""


def _left_mib(kib: int) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(kib)], capture_output=True, text=True, check=True,
                         timeout=60)
    applied, left = out.stdout.split()
    return applied, float(left)


def test_fixed_threshold_returns_freed_large_blocks() -> None:
    applied, dynamic = _left_mib(0)
    assert applied == "False" and dynamic > 150  # glibc's default kept the 200 MiB of holes resident
    applied, fixed = _left_mib(128)
    assert applied == "True" and fixed < 20, fixed


def test_zero_leaves_glibc_alone() -> None:
    from meshrl.forkpool import set_heap_mmap_threshold

    assert set_heap_mmap_threshold(0) is False
