"""An experiment directory has one writer at a time, a summary says what is unfinished, and the workers die with
the experiment and compute on one thread (README.md, "Running an experiment")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from experiments.collapse_testbed.cli import main
from experiments.collapse_testbed.experiment import experiment_lock, worker_pool
from experiments.collapse_testbed.regenerate import HERE

ROOT = Path(__file__).resolve().parents[3]


def _unpacked_audit(tmp_path: Path) -> Path:
    out = tmp_path / "exp"
    assert main(["--unpack", str(HERE / "data" / "testbed_audit.json.gz"), "--summarize-only", "--out", str(out),
                 "--no-figures", "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("extra", [["--summarize-only"], ["--steps", "2", "--no-progress"]])
def test_a_second_experiment_or_summary_is_one_line_naming_the_holder(tmp_path, capsys, extra):
    out = tmp_path / "exp"
    (out / "runs").mkdir(parents=True)
    with experiment_lock(out):
        assert main(["--out", str(out), "--no-figures", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"pid {os.getpid()}" in err and "another experiment" in err
    assert not (out / "results.json").exists()  # nothing summarized while the lock was held


@pytest.mark.parametrize("extra", [["--summarize-only"], ["--summarize-only", "--unpack", "x.json.gz"], []])
def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys, extra):
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    assert main(["--out", str(out), "--no-figures", "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--out {out} is a file" in err and out.read_text() == "mine\n"


def test_a_summary_of_an_unfinished_experiment_says_so(tmp_path, capsys, caplog):
    out = _unpacked_audit(tmp_path)
    assert "incomplete" not in json.loads((out / "results.json").read_text())
    runs = sorted((out / "runs").glob("*/seed_*"))
    (runs[0] / "done.json").unlink()  # killed after its evaluation
    half = runs[1].parent / "seed_99"
    half.mkdir()  # killed while training: no evaluation yet
    (half / "metrics.jsonl").write_text('{"step": 1}\n')
    lines = (out / "baseline_probes.jsonl").read_text().splitlines(keepends=True)
    (out / "baseline_probes.jsonl").write_text("".join(lines[:2]))
    capsys.readouterr()
    assert main(["--out", str(out), "--summarize-only", "--no-figures", "--no-progress"]) == 0
    incomplete = json.loads((out / "results.json").read_text())["incomplete"]
    rel = f"runs/{runs[0].parent.name}/{runs[0].name}"
    assert [i.split(" ")[0] for i in incomplete] == [rel, f"runs/{half.parent.name}/seed_99", "baseline_probes.jsonl"]
    assert "partial" in incomplete[0] and "left out" in incomplete[1] and "2 of 5" in incomplete[2]
    assert (out / "results.md").read_text().startswith("**Incomplete experiment**")
    assert any("incomplete experiment" in r.getMessage() for r in caplog.records)


def _thread_count() -> int:
    import torch

    return torch.get_num_threads()


def test_workers_compute_on_one_thread_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # what a spawned worker would take by default
    with worker_pool(1) as pool:
        assert pool.submit(_thread_count).result() == 1


PARENT = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = [{root!r}, {src!r}]
    from experiments.collapse_testbed.experiment import worker_pool

    def job(marks):  # in a worker, so after its set-up: say so, then work for long
        open(os.path.join(marks, str(os.getpid())), "w").close()
        time.sleep(300)

    if __name__ == "__main__":  # the spawned workers import this file too
        pool = worker_pool(2)
        futures = [pool.submit(job, {marks!r}) for _ in range(2)]
        while len(os.listdir({marks!r})) < 2:
            time.sleep(0.05)
        print(" ".join(os.listdir({marks!r})), flush=True)
        time.sleep(300)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_killed_experiment(tmp_path):
    script = tmp_path / "parent.py"
    (tmp_path / "marks").mkdir()
    script.write_text(PARENT.format(root=str(ROOT), src=str(ROOT / "src"), marks=str(tmp_path / "marks")))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert workers and all(_alive(p) for p in workers)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in workers if _alive(p)]
    finally:
        parent.kill()
        for pid in workers if "workers" in locals() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


TOY = dict(steps=2, prompts_per_step=2, group_size=3, probe_every=1, probe_problems=3, probe_group=3, eval_problems=6,
           eval_n=2, ks=(1, 2), seeds=(0,), arms=("grpo", "mesh_mu1e-1", "support_mu1"), warm_steps=2, workers=2)
KILLED = textwrap.dedent("""
    import sys
    sys.path[:0] = [{root!r}, {src!r}]
    from pathlib import Path
    from experiments.collapse_testbed.experiment import ExperimentSettings, run_experiment
    if __name__ == "__main__":
        run_experiment(Path({out!r}), ExperimentSettings(**{toy!r}), progress=False)
""")


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _comparable(out: Path) -> dict:
    from experiments.collapse_testbed.results import summarize_experiment

    def timeless(x):  # wall-clock figures differ between any two runs
        if isinstance(x, dict):
            return {k: timeless(v) for k, v in x.items() if "seconds" not in str(k)}
        return [timeless(v) for v in x] if isinstance(x, list) else x

    res = summarize_experiment(out)
    return {k: json.dumps(timeless(res[k]), default=str).replace(str(out), "OUT")
            for k in ("arms", "warning", "warning_training", "mei_vs_truth", "paired_vs_grpo", "curves")}


@pytest.mark.slow  # three toy experiments: about a minute on 2 cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_experiment_killed_mid_way_leaves_no_worker_and_reruns_exactly(tmp_path, monkeypatch):
    """SIGKILL of the parent while the warm-start probes run: the workers are gone at once, and the rerun, on
    another default thread count, gives the uninterrupted experiment's tables exactly."""
    from experiments.collapse_testbed.experiment import ExperimentSettings, run_experiment

    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    whole = run_experiment(tmp_path / "whole", ExperimentSettings(**TOY), progress=False)
    killed = tmp_path / "killed"
    script = tmp_path / "killed.py"
    script.write_text(KILLED.format(root=str(ROOT), src=str(ROOT / "src"), out=str(killed), toy=TOY))
    parent = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        base = killed / "baseline_probes.jsonl"
        while not (base.is_file() and base.read_text().count("\n") >= 1) and time.monotonic() < deadline:
            workers = sorted(set(workers) | set(_children(parent.pid)))
            time.sleep(0.05)
        assert parent.poll() is None, "the experiment ended before the kill"
        workers = sorted(set(workers) | set(_children(parent.pid)))
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers and not [p for p in workers if _alive(p)]
    finally:
        parent.kill()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    run_experiment(killed, ExperimentSettings(**TOY), progress=False)
    assert _comparable(killed) == _comparable(whole)


def test_a_run_the_trainer_aborts_is_recorded_named_packed_and_never_resumed(tmp_path, monkeypatch):
    """NonFiniteAbort (or a stall, a health stop, failed rewards) ends one run: its done.json says why, the worker
    returns normally (the grid goes on), the tables' list of what is missing names it, the pack keeps it, and a
    second call leaves it alone (a resume would reset the failure counters)."""
    import meshrl.trainer
    from experiments.collapse_testbed import experiment as E
    from experiments.collapse_testbed.pack import pack_experiment
    from experiments.collapse_testbed.results import incomplete_parts
    from meshrl.trainer import NonFiniteAbort

    calls = []

    def aborting(cfg, run_dir, resume=False):
        calls.append(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss/total": "nan"}) + "\n")
        raise NonFiniteAbort("3 consecutive steps with a non-finite loss")

    monkeypatch.setattr(meshrl.trainer, "train", aborting)
    out = tmp_path / "exp"
    run_dir = out / "runs" / "grpo" / "seed_0"
    s = E.ExperimentSettings(**{k: v for k, v in TOY.items() if k != "workers"})
    result = E._job("grpo", 0, run_dir, s, tmp_path / "warm")
    assert result["aborted"] == "NonFiniteAbort at step 3: 3 consecutive steps with a non-finite loss"
    assert E.aborted(run_dir) == result["aborted"] and not (run_dir / "eval").exists()
    assert E._job("grpo", 0, run_dir, s, tmp_path / "warm")["skipped"] == "done" and len(calls) == 1
    assert incomplete_parts(out) == [f"runs/grpo/seed_0 (aborted by the trainer, {result['aborted']}: not "
                                     "evaluated, left out of the tables)"]
    assert pack_experiment(out, tmp_path / "p.json.gz")["runs"] == 1
