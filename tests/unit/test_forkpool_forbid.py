"""``meshrl.forkpool.forbid_fork``: once something has started lock-holding threads in the process (vLLM's
in-process engine), no worker is forked: ``fork_available`` turns False and ``ForkPool`` refuses, naming why."""

from __future__ import annotations

import pytest
import torch

from meshrl import forkpool


@pytest.fixture()
def clean_flag(monkeypatch):
    monkeypatch.setattr(forkpool, "_FORK_UNSAFE", [])


def test_forbid_fork_turns_fork_off_and_names_the_reason(clean_flag):
    forkpool.forbid_fork("an engine's threads run here")
    forkpool.forbid_fork("an engine's threads run here")  # said once
    assert forkpool._FORK_UNSAFE == ["an engine's threads run here"]
    assert not forkpool.fork_available()
    with pytest.raises(RuntimeError, match="forking is off in this process .an engine's threads run here"):
        forkpool.ForkPool(torch.nn.Linear(2, 2), abs, workers=2)


def test_update_and_decode_fall_back_to_one_process(clean_flag):
    from meshrl.models import build_tiny
    from meshrl.rollout import make_backend
    from meshrl.rollout.base import SamplingParams
    from meshrl.trainer.parallel_update import update_worker_count

    model, tok = build_tiny("tiny", seed=0)
    forkpool.forbid_fork("test")
    assert update_worker_count(2, model) == 1
    native = make_backend("native", model, tok, workers=2)
    out = native.generate([[1, 5, 6]], SamplingParams(n=32, temperature=1.0, max_new_tokens=3), seed=0)
    assert len(out.response_ids) == 32 and native.workers == 1
