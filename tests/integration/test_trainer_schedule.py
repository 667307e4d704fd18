"""Learning-rate schedules (optim.schedule): hand-computed values, config errors, logging and exact resume."""

from __future__ import annotations

import math

import pytest
import yaml

from meshrl.jsonl import read_jsonl
from meshrl.trainer import load_config, train
from meshrl.trainer.config import OptimConfig
from meshrl.trainer.schedule import lr_at


def _optim(schedule: str, warmup: int = 0, floor: float = 0.0, lr: float = 1.0) -> OptimConfig:
    return OptimConfig(lr=lr, warmup_steps=warmup, schedule=schedule, min_lr_ratio=floor)


# Hand-computed: T = 10 steps, W = 2 warm-up steps, so p = (i - 2) / 8 after warm-up.
@pytest.mark.parametrize(
    ("schedule", "floor", "index", "expected"),
    [
        ("constant", 0.0, 0, 0.5),  # warm-up: (0 + 1) / 2
        ("constant", 0.0, 1, 1.0),  # last warm-up step reaches the peak
        ("constant", 0.0, 9, 1.0),
        ("linear", 0.0, 0, 0.5),
        ("linear", 0.0, 2, 1.0),  # p = 0
        ("linear", 0.0, 6, 0.5),  # p = 4/8: 1 - 0.5
        ("linear", 0.0, 9, 0.125),  # p = 7/8: 1 - 0.875
        ("linear", 0.2, 6, 0.6),  # 0.2 + 0.8 * 0.5
        ("linear", 0.2, 9, 0.3),  # 0.2 + 0.8 * 0.125
        ("cosine", 0.0, 2, 1.0),  # cos(0) = 1
        ("cosine", 0.0, 4, 0.5 * (1 + math.cos(math.pi / 4))),  # p = 2/8: 0.853553...
        ("cosine", 0.0, 6, 0.5),  # p = 1/2: cos(pi/2) = 0
        ("cosine", 0.1, 6, 0.55),  # 0.1 + 0.9 * 0.5
        ("cosine", 0.1, 9, 0.1 + 0.9 * 0.5 * (1 + math.cos(7 * math.pi / 8))),  # 0.1171...
    ],
)
def test_hand_computed_rates(schedule, floor, index, expected):
    assert lr_at(_optim(schedule, warmup=2, floor=floor), index, 10) == pytest.approx(expected, rel=1e-12)


def test_decay_reaches_the_floor_only_after_the_last_step():
    opt = _optim("linear", floor=0.25, lr=2e-5)
    rates = [lr_at(opt, i, 4) for i in range(5)]
    assert rates == pytest.approx([2e-5, 1.625e-5, 1.25e-5, 0.875e-5, 0.5e-5])  # i = 4 is the rate after step 4
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False))


def test_no_warmup_and_one_step_runs():
    assert lr_at(_optim("cosine"), 0, 1) == 1.0
    assert lr_at(_optim("linear", warmup=5), 0, 3) == pytest.approx(0.2)  # warm-up longer than the run


@pytest.mark.parametrize(
    ("override", "needle"),
    [("optim.schedule=exponential", "optim.schedule"), ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio"),
     ("optim.min_lr_ratio=-0.1", "optim.min_lr_ratio"), ("optim.warmup_steps=-1", "optim.warmup_steps"),
     ("optim.warmup_steps=1.5", "optim.warmup_steps")],
)
def test_bad_schedule_settings_name_the_key(override, needle):
    with pytest.raises(ValueError, match=needle):
        load_config(overrides=[override])


FAST = ["model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=3", "log.progress=false", "checkpoint.every=1", "optim.lr=1e-3",
        "optim.schedule=cosine", "optim.min_lr_ratio=0.1", "optim.warmup_steps=1", "train.update_workers=1"]


def test_lr_is_logged_per_step_and_a_resume_sets_the_same_rates(tmp_path):
    full = train(load_config(overrides=[*FAST, "steps=4"]), tmp_path / "full")
    expected = [lr_at(load_config(overrides=FAST).optim, i, 4) for i in range(4)]
    assert [m["lr"] for m in full] == pytest.approx(expected, rel=1e-12)
    assert [m["lr"] for m in read_jsonl(tmp_path / "full" / "metrics.jsonl")] == pytest.approx(expected)

    train(load_config(overrides=[*FAST, "steps=2"]), tmp_path / "resumed")
    cfg = load_config(tmp_path / "resumed" / "config.yaml", ["steps=4"])
    resumed = train(cfg, tmp_path / "resumed", resume=True)
    assert [m["step"] for m in resumed] == [3, 4]
    assert [m["lr"] for m in resumed] == pytest.approx(expected[2:], rel=1e-12)
    assert [m["loss/policy"] for m in resumed] == pytest.approx([m["loss/policy"] for m in full[2:]], abs=1e-6)
    saved = yaml.safe_load((tmp_path / "resumed" / "config.yaml").read_text())
    assert saved["optim"]["schedule"] == "cosine" and saved["optim"]["min_lr_ratio"] == pytest.approx(0.1)


def test_decay_equals_hugging_face_schedulers_and_warmup_is_one_step_ahead():
    import torch
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    T, W = 12, 3
    for schedule, make in (("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = make(opt, num_warmup_steps=W, num_training_steps=T)
        hf = []
        for _ in range(T):
            hf.append(opt.param_groups[0]["lr"])  # the rate of update i
            opt.step()
            sched.step()
        ours = [lr_at(_optim(schedule, warmup=W), i, T) for i in range(T)]
        assert ours[W:] == pytest.approx(hf[W:], rel=1e-12), schedule
        assert ours[: W - 1] == pytest.approx(hf[1:W], rel=1e-12) and hf[0] == 0.0
