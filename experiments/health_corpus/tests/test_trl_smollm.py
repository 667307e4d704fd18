"""The TRL part of the doctor's corpus: its labels follow the corpus schema, and the lr fault acts from its step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from experiments.health_corpus import trl_smollm  # noqa: E402


def test_labels_follow_the_schema():
    healthy, blown = trl_smollm.label("healthy", 0, 400.0), trl_smollm.label("lr_blowup", 1, 411.0)
    assert (healthy["outcome"], healthy["fault_step"], healthy["split"], healthy["engine"]) == (
        "healthy", None, "tune", "trl")
    assert (blown["outcome"], blown["fault_step"], blown["split"]) == ("harmful", trl_smollm.FAULT_STEP, "report")
    assert healthy["harm_step"] is None and blown["id"] == "smollm2/trl/lr_blowup/s1"


def test_lr_blowup_scales_the_rate_once_from_its_step():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # TRL's constant schedule
    cb = trl_smollm._lr_blowup_callback(100.0, at_step=3)
    for step in range(5):  # on_step_begin of steps 1..5 (global_step counts finished steps)
        cb.on_step_begin(None, SimpleNamespace(global_step=step), None, optimizer=opt, lr_scheduler=sched)
        rate = opt.param_groups[0]["lr"]
        assert rate == pytest.approx(1e-6 if step + 1 < 3 else 1e-4), step
        opt.step()
        sched.step()  # the schedule recomputes from base_lrs: the raised rate survives it
