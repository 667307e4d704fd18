"""release_free_heap hands freed C heap pages back to the kernel (what a forked worker would otherwise inherit)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshrl.forkpool import _malloc_trim

pytestmark = pytest.mark.skipif(_malloc_trim() is None or not sys.platform.startswith("linux"),
                                reason="needs glibc's malloc_trim and /proc")

# 3000 blocks of 64 KiB (under glibc's mmap threshold: they come from the heap), every other one freed: the holes
# (~94 MiB) cannot be trimmed from the top of the heap, so they stay resident until malloc_trim.
PROGRAM = """
import re
from meshrl.forkpool import release_free_heap

def rss_kb():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1))

blocks = [bytes([i % 251]) * (64 * 1024) for i in range(3000)]
del blocks[::2]
before = rss_kb()
release_free_heap()
print(before, rss_kb())
"""


def test_release_free_heap_returns_freed_holes() -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True, timeout=60)
    before, after = map(int, out.stdout.split())
    assert before - after > 60 * 1024, (before, after)  # most of the ~94 MiB of holes left the process


def test_a_training_step_hands_the_updates_freed_pages_back(tmp_path, monkeypatch) -> None:
    """After the update and AdamW (gradients already dropped), the step trims the heap before the next rollout."""
    import meshrl.forkpool
    from meshrl.trainer import Trainer, load_config

    cfg = load_config(overrides=["model=tiny", "task=tiny:add", "steps=2", "rollout.prompts_per_step=2",
                                 "rollout.group_size=2", "rollout.max_new_tokens=4", "log.progress=false"])
    trainer = Trainer(cfg, tmp_path / "run")
    grads_at_trim = []
    monkeypatch.setattr(meshrl.forkpool, "release_free_heap",  # called through the run's speed path
                        lambda: grads_at_trim.append([p.grad is None for p in trainer.params]))
    trainer.step()
    trainer.close()
    assert len(grads_at_trim) == 1 and all(grads_at_trim[0])
