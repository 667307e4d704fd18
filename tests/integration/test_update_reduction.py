"""The update's result does not depend on how many processes compute it: a run whose update workers are gone (killed
by a signal or the OOM killer, or never started) computes the same parts in one process and gets bitwise the same
gradients, metrics and weights, so that a resumed run equals the uninterrupted one (docs/reliability.md)."""

from __future__ import annotations

import pytest
import torch

from meshrl.forkpool import fork_available
from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config

pytestmark = pytest.mark.skipif(not fork_available(), reason="worker processes need fork (Linux)")

TINY = [*TINY_RUN, "rollout.max_new_tokens=8", "optim.lr=1e-4", "train.update_workers=2"]


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    return Trainer(load_config(overrides=[*TINY, *extra]), tmp_path / name)


def _batch(trainer: Trainer, seed: int):
    """A step's rollouts with varied lengths (one empty), random advantages and two groups of zero advantage."""
    data, _ = trainer.sampler.run(0, 0)
    g = torch.Generator().manual_seed(seed)
    for j, r in enumerate(data.response_ids):
        data.response_ids[j] = r[: int(torch.randint(1, len(r) + 1, (1,), generator=g))]
    data.response_ids[1] = []
    data.advantages = torch.randn(len(data), generator=g)
    data.advantages[0:4] = 0.0
    data.advantages[8:12] = 0.0
    return data


def _assert_bitwise(a: Trainer, b: Trainer, m_a: dict, m_b: dict) -> None:
    assert m_a == m_b
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad)
        assert torch.equal(p, q)


@pytest.mark.parametrize("extra", [
    ["recipe=grpo", "train.micro_batch_size=5"],  # several micro-batches per mini-batch
    ["recipe=grpo_kl", "train.ppo_epochs=2", "train.mini_batches=2", "train.micro_batch_size=3"],
    ["recipe=dapo", "train.micro_batch_size=6", "train.ppo_epochs=2"],
    ["recipe=grpo", "train.micro_batch_size=16", "train.skip_zero_advantage=false"],
])
def test_one_process_computes_the_parts_bitwise_as_two_do(tmp_path, extra):
    two, one = _trainer(tmp_path, "two", *extra), _trainer(tmp_path, "one", *extra)
    one.engine.workers_wanted = 1  # as after its workers died or could not start
    try:
        for seed in (0, 1):  # the second update reads the weights the first one wrote
            data = _batch(two, seed)
            m_two, m_one = two.update(data), one.update(data)
            assert two.engine.started and not one.engine.started
            _assert_bitwise(two, one, m_two, m_one)
    finally:
        two.close()
        one.close()


def test_a_worker_killed_between_updates_changes_no_bit(tmp_path):
    extra = ["train.micro_batch_size=5", "train.mini_batches=2", "train.ppo_epochs=2"]
    kept, killed = _trainer(tmp_path, "kept", *extra), _trainer(tmp_path, "killed", *extra)
    try:
        data = _batch(kept, 2)
        _assert_bitwise(kept, killed, kept.update(data), killed.update(data))
        pool = killed.engine.workers(killed.params).pool
        pool.procs[0].kill()  # SIGKILL: the next update finds the worker gone mid-mini-batch and redoes it here
        pool.procs[0].join()
        data = _batch(kept, 3)
        _assert_bitwise(kept, killed, kept.update(data), killed.update(data))
        assert not killed.engine.started and killed.engine.workers_wanted == 1
        data = _batch(kept, 4)  # and the run goes on in one process, still bitwise
        _assert_bitwise(kept, killed, kept.update(data), killed.update(data))
    finally:
        kept.close()
        killed.close()


def test_one_configured_part_keeps_the_plain_one_process_path(tmp_path):
    t = _trainer(tmp_path, "t", "train.update_workers=1")
    try:
        assert t.engine.parts == 1
        t.update(_batch(t, 5))
        assert t.engine._here is None  # no part buffers: the gradients go straight to .grad, all threads
    finally:
        t.close()


# A plug-in that, once, sends SIGTERM to its run's process group at the start of step 2's sampling and then keeps
# sampling for longer than an idle update worker used to outlive such a signal.
SIGNALLER = '''
import os, signal, time
from dataclasses import dataclass

from meshrl.settings import setting
from meshrl.trainer.plugins import Plugin, Stage


@dataclass
class SignalConfig:
    enabled: bool = setting(True, help="on")
    marker: str = setting("", help="signal only while this file does not exist")


class SignalDuringSampling(Plugin):
    name = "signal_during_sampling"
    Config = SignalConfig
    stage = Stage.SAMPLING
    calls = 0

    def before_sampling(self, sampler):
        self.calls += 1
        if self.calls == 2 and not os.path.exists(self.cfg.marker):
            open(self.cfg.marker, "w").close()
            os.killpg(os.getpgrp(), signal.SIGTERM)
            time.sleep(6)
'''


@pytest.mark.slow
def test_a_group_sigterm_during_sampling_resumes_bitwise(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    import meshrl
    from meshrl.jsonl import read_jsonl

    (tmp_path / "signaller.py").write_text(SIGNALLER)
    src = str(Path(meshrl.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(tmp_path)]), "HF_HUB_OFFLINE": "1"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "import sys; from meshrl.cli import main; sys.exit(main())",
                               *args], env=env, capture_output=True, text=True, timeout=300, start_new_session=True)

    def train(run: Path, marker: Path) -> list[str]:
        return ["train", "--out", str(run), "--model", "tiny", "--task", "tiny:repeat", "--no-progress",
                "--steps", "4", "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4",
                "--set", "rollout.max_new_tokens=6", "--set", "train.update_workers=2",
                "--set", "train.mini_batches=2", "--set", "train.micro_batch_size=3", "--set", "optim.lr=1e-2",
                "--set", "checkpoint.every=2",
                "--set", f"plugins.custom=[{{path: 'signaller:SignalDuringSampling', marker: '{marker}'}}]"]

    done = tmp_path / "signalled"
    done.touch()
    reference = cli(*train(tmp_path / "reference", done))
    assert reference.returncode == 0, reference.stderr[-2000:]
    stopped = cli(*train(tmp_path / "run", tmp_path / "marker"))
    assert stopped.returncode == 128 + 15 and (tmp_path / "marker").exists(), stopped.stderr[-2000:]
    assert "worker process died" not in stopped.stderr
    resumed = cli("train", "--resume", str(tmp_path / "run"), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    def records(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                for r in read_jsonl(run / "metrics.jsonl")]

    assert records(tmp_path / "run") == records(tmp_path / "reference")
    a, b = (load_file(str(r / "checkpoints" / "step_000004" / "model.safetensors"))
            for r in (tmp_path / "run", tmp_path / "reference"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
