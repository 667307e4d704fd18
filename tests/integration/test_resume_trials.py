"""Random-moment kill trials of ``meshrl train``: SIGTERM or SIGKILL to the whole process group at
a uniformly random moment of training, then ``--resume`` until the run is done; the records and the final
weights must equal those of the uninterrupted run, bit for bit (CPU).

The default worker processes (update and decode) run, so a group signal reaches them too. CI runs 5 trials of
each kind; ``python tests/integration/test_resume_trials.py N`` runs N of each and prints the tally
(docs/reliability.md).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import meshrl
from meshrl.jsonl import read_jsonl
from meshrl.runs import latest_checkpoint

STEPS = 6
TRAIN = ["train", "--model", "tiny", "--task", "tiny:repeat", "--no-progress", "--steps", str(STEPS),
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "rollout.max_new_tokens=6",
         "--set", "train.mini_batches=2", "--set", "optim.lr=1e-2", "--set", "checkpoint.every=2",
         "--set", "log.samples_per_step=2"]
TIME_KEYS = ("time/", "throughput/")
RECORDS = ("metrics.jsonl", "samples.jsonl")


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, "-c", "import sys; from meshrl.cli import main; sys.exit(main())", *args]


def _env() -> dict[str, str]:
    src = str(Path(meshrl.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(args), env=_env(), capture_output=True, text=True, timeout=600)


def _records(run: Path) -> dict[str, list[dict]]:
    return {name: [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in read_jsonl(run / name)]
            for name in RECORDS}


def _final_weights(run: Path) -> dict:
    return load_file(str(run / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))


def reference(root: Path) -> tuple[Path, float]:
    """The uninterrupted run and how long its training took (config.yaml written -> exit)."""
    run = root / "reference"
    proc = subprocess.Popen(_cli([*TRAIN, "--out", str(run)]), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    started = _wait_for(run / "config.yaml", proc)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return run, time.monotonic() - started


def _wait_for(path: Path, proc: subprocess.Popen) -> float:
    while not path.exists() and proc.poll() is None:
        time.sleep(0.01)
    return time.monotonic()


def trial(root: Path, ref: Path, window_s: float, sig: int, seed: int) -> tuple[bool, str]:
    """One kill at a random moment and the resumes after it; ``(identical to ref, what happened)``."""
    run = root / f"{signal.Signals(sig).name}_{seed}"
    proc = subprocess.Popen(_cli([*TRAIN, "--out", str(run)]), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_for(run / "config.yaml", proc)
    delay = random.Random(seed).uniform(0, window_s)
    time.sleep(delay)
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    proc.communicate(timeout=600)
    rc, first = proc.returncode, proc.returncode
    for _ in range(3):  # resume (or, killed before the first checkpoint, the same command again)
        if rc == 0:
            break
        # the rule `meshrl train` itself applies (a kill between a checkpoint's rename and its `latest` pointer
        # leaves a complete checkpoint without the pointer: a fresh run refuses it and says --resume)
        has_ckpt = latest_checkpoint(run) is not None
        done = _run(["train", "--resume", str(run)] if has_ckpt else [*TRAIN, "--out", str(run)])
        if done.returncode != 0:
            return False, f"delay {delay:.2f}s rc {first}; then rc {done.returncode}: {done.stderr[-500:]}"
        rc = 0
    same = _records(run) == _records(ref)
    weights, theirs = _final_weights(run), _final_weights(ref)
    same = same and weights.keys() == theirs.keys() and all((weights[k] == theirs[k]).all() for k in weights)
    return same, f"delay {delay:.2f}s of {window_s:.2f}s, first rc {proc.returncode}"


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("trials"))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_random_moment_kills_resume_into_the_same_run(tmp_path, ref_run, sig):
    ref, window = ref_run
    results = [trial(tmp_path, ref, window, sig, seed) for seed in range(5)]
    failed = [what for ok, what in results if not ok]
    assert not failed, failed


if __name__ == "__main__":
    import tempfile

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        ref, window = reference(root)
        print(f"reference: training window {window:.2f}s")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            outcomes = [trial(root, ref, window, sig, 1000 + seed) for seed in range(n)]
            for ok, what in outcomes:
                print(signal.Signals(sig).name, "ok" if ok else "DIFFERENT", what)
            print(f"{signal.Signals(sig).name}: {sum(ok for ok, _ in outcomes)}/{n} identical to the uninterrupted run")
