"""benchmarks/memory_vs_trl.py: the sampler sums PSS over a process tree (a forked child's pages count), and the
driver's meshrl side runs end to end on ``tiny``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from memory_vs_trl import TreeSampler, process_tree, smaps_pss, tree_pss  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux smaps_rollup")

MB = 2**20
# A parent that fills 120 MB, forks, and a child that fills 120 MB of its own: the tree holds >= 240 MB of data.
ALLOC_AND_FORK = """
import os, sys, time
mine = b"\\x01" * (120 * 2**20)
pid = os.fork()
if pid == 0:
    own = b"\\x02" * (120 * 2**20)
    print("child ready", flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


@pytest.fixture
def forked_tree():
    proc = subprocess.Popen([sys.executable, "-c", ALLOC_AND_FORK], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "child ready"
        yield proc.pid
    finally:
        for pid in process_tree(proc.pid)[1:]:
            os.kill(pid, 9)
        proc.kill()
        proc.wait()


def test_tree_pss_counts_a_forked_childs_pages(forked_tree: int) -> None:
    pids = process_tree(forked_tree)
    assert len(pids) == 2 and pids[0] == forked_tree
    total, per_pid = tree_pss(forked_tree)
    assert set(per_pid) == set(pids)
    assert total["Pss"] == sum(per_pid.values())
    assert total["Pss"] >= 240 * MB  # the parent's 120 MB (shared with the child, counted once) + the child's own
    root_alone = smaps_pss(forked_tree)
    assert root_alone is not None and root_alone["Pss"] < total["Pss"] - 100 * MB  # the root alone misses the child


def test_sampler_tags_samples_with_the_current_step(forked_tree: int) -> None:
    sampler = TreeSampler(forked_tree, interval=0.02).start()
    time.sleep(0.2)
    sampler.step, sampler.phase = 1, "update"
    time.sleep(0.2)
    sampler.stop()
    assert {s.phase for s in sampler.samples} == {"setup", "update"}
    assert all(len(s.per_pid) == 2 and s.pss["Pss"] >= 240 * MB for s in sampler.samples)


def test_meshrl_side_dry_run_on_tiny(tmp_path: Path) -> None:
    out = tmp_path / "mem.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_vs_trl.py"), "--sides", "meshrl", "--model", "tiny",
           "--steps", "2", "--prompts", "2", "--group", "2", "--tokens", "8", "--interval", "0.01",
           "--set", "rollout.decode_workers=2", "--json", str(out)]
    subprocess.run(cmd, check=True, env=env, timeout=120, capture_output=True)
    r = json.loads(out.read_text())["sides"]["meshrl"]
    assert r["max_processes"] >= 2  # the forked decoder was sampled with its parent
    assert 0.05 < r["peak_gb"] <= r["peak_whole_gb"] < 8
    assert set(r["per_step_peak_gb"]) == {"1", "2"}
    assert "rollout" in r["per_phase_peak_gb"]


@pytest.mark.slow
def test_both_sides_draw_meshrls_problem_order_on_tiny(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    out = tmp_path / "mem.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_vs_trl.py"), "--sides", "meshrl,trl", "--model", "tiny",
           "--steps", "3", "--prompts", "3", "--group", "2", "--tokens", "4", "--interval", "0.01", "--json", str(out)]
    # each child raises (and the driver reports a failed side) when a step's problems are not meshrl's order
    subprocess.run(cmd, check=True, env=env, timeout=300, capture_output=True)
    sides = json.loads(out.read_text())["sides"]
    for name in ("meshrl", "trl"):
        assert sides[name]["complete"] and set(sides[name]["per_step_peak_gb"]) == {"1", "2", "3"}


def test_trl_child_runs_with_pytorch_kernel_cache_sizes_unless_asked(monkeypatch):
    """The driver bounds oneDNN's kernel caches as meshrl's command line does, so TRL's child is handed PyTorch's own
    sizes back (as TRL's users run it) unless --trl-kernel-caches meshrl. meshrl's child inherits the driver's."""
    import argparse

    from memory_vs_trl import side_env

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "128")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
    plain = argparse.Namespace()
    assert {side_env("trl", plain)[k] for k in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")} == {"1024"}
    assert side_env("meshrl", plain)["LRU_CACHE_CAPACITY"] == "128"
    same = argparse.Namespace(trl_kernel_caches="meshrl")
    assert side_env("trl", same)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128"
