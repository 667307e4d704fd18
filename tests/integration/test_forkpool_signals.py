"""Worker processes ignore the SIGTERM / SIGINT sent to the whole process group (a terminal's Ctrl-C, ``timeout``, a
job scheduler): they stay until the parent, which handles the signal, releases them; and they end with the parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from meshrl.forkpool import ForkPool, fork_available

pytestmark = pytest.mark.skipif(not fork_available(), reason="worker processes need fork (Linux)")


def _double(x: int) -> int:
    return 2 * x


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _ignored_signals(pid: int) -> set[int]:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return {s for s in range(1, 64) if mask >> (s - 1) & 1}


def test_workers_ignore_sigterm_and_sigint_and_keep_serving():
    pool = ForkPool(torch.nn.Linear(2, 2), _double, workers=2)
    try:
        pid = pool.procs[0].pid
        assert pool.map(_double, [(0,), (1,)]) == [0, 2]  # the worker is up
        assert {signal.SIGINT, signal.SIGTERM} <= _ignored_signals(pid)
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert _alive(pid)
        assert pool.map(_double, [(1,), (2,)]) == [2, 4]
    finally:
        pool.close()
    assert not _alive(pid)  # released by the parent


# Its own process group: the signal goes to the group, the parent (StopRequests, as in `meshrl train`) records it,
# waits longer than an idle worker used to survive a SIGTERM, uses its workers, then releases them.
GROUP_RUN = textwrap.dedent("""
    import os, sys, time, torch
    from meshrl.forkpool import ForkPool
    from meshrl.trainer.signals import StopRequests

    def double(x):
        return 2 * x

    with StopRequests() as stops:
        pool = ForkPool(torch.nn.Linear(2, 2), double, workers=3)
        print(*[p.pid for p in pool.procs], flush=True)
        while not stops.requested:
            time.sleep(0.05)
        time.sleep(float(sys.argv[1]))
        print(pool.map(double, [(1,), (2,), (3,)]), flush=True)
        pool.close()
        print(all(not p.is_alive() for p in pool.procs), flush=True)
""")


def test_a_sigterm_to_the_process_group_leaves_the_workers_to_the_parent():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", GROUP_RUN, "6"], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        workers = [int(x) for x in proc.stdout.readline().split()]
        assert len(workers) == 2
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and out.split("\n")[:2] == ["[2, 4, 6]", "True"]


# A parent killed outright while a process it forked still holds its pipe ends open: no EOF reaches the workers.
ORPHANED = textwrap.dedent("""
    import os, signal, time, torch
    from meshrl.forkpool import ForkPool

    def double(x):
        return 2 * x

    pool = ForkPool(torch.nn.Linear(2, 2), double, workers=2)
    holder = os.fork()
    if holder == 0:
        time.sleep(30)
        os._exit(0)
    print(pool.procs[0].pid, holder, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_workers_end_with_their_parent_even_when_their_pipe_stays_open():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", ORPHANED], stdout=subprocess.PIPE, text=True, env=env)
    worker, holder = (int(x) for x in proc.stdout.readline().split())
    proc.wait(timeout=30)
    try:
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        for pid in (worker, holder):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
