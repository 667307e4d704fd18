"""CPUs without native bf16 (AVX2 without AVX-512): what meshrl asks PyTorch, the start-up warning that names the
setting, the ``bf16_emulated`` event and the doctor's finding. Each runs on every CPU: the capability is
monkeypatched where the test needs the other answer."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from meshrl import cpu
from meshrl.doctor import diagnose
from meshrl.testing import tiny_config
from meshrl.trainer import train


def test_bf16_gemm_native_agrees_with_the_reorder_it_predicts():
    """True exactly where oneDNN reorders a bf16 weight (the op the native decoder's prepack needs)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), None)
        reorders = True
    except RuntimeError:
        reorders = False
    assert cpu.bf16_gemm_native() is (reorders and torch.backends.mkldnn.is_available())


def test_cpu_info_records_what_a_figure_depends_on(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    info = cpu.cpu_info()
    assert {"model", "capability", "bf16_native", "flags", "cpus", "torch_threads", "torch"} <= set(info)
    assert info["torch"] == torch.__version__  # the build rounds as much as the CPU does
    assert info["capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(info["flags"]) <= set(cpu.KERNEL_FLAGS) and info["isa_overrides"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    json.dumps(info)


def test_the_warning_names_each_setting_and_its_float32_alternative(monkeypatch, caplog):
    settings = {"train.autocast_bf16=true": True, "train.dtype=bfloat16": True, "rollout.autocast_bf16=true": False}
    monkeypatch.setattr(cpu, "bf16_gemm_native", lambda: True)
    with caplog.at_level(logging.WARNING, "meshrl"):
        assert cpu.warn_emulated_bf16(settings) == []
    assert not caplog.records
    monkeypatch.setattr(cpu, "bf16_gemm_native", lambda: False)
    with caplog.at_level(logging.WARNING, "meshrl"):
        assert cpu.warn_emulated_bf16(settings) == ["train.autocast_bf16=true", "train.dtype=bfloat16"]
        assert cpu.warn_emulated_bf16({"train.autocast_bf16=true": False}) == []
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "train.autocast_bf16=false and train.dtype=float32" in msg and "525 s" in msg
    assert "rollout.autocast_bf16" not in msg


@pytest.mark.parametrize("native", [True, False])
def test_a_run_with_emulated_bf16_warns_records_it_and_the_doctor_flags_it(native, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu, "bf16_gemm_native", lambda: native)
    cfg = tiny_config("train.autocast_bf16=true", "rollout.autocast_bf16=true", steps=2)
    with caplog.at_level(logging.WARNING, "meshrl"):
        train(cfg, tmp_path / "run")
    warned = [r.getMessage() for r in caplog.records if "bf16 is emulated" in r.getMessage()]
    events_file = tmp_path / "run" / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.is_file() else []
    slow = [e for e in events if e["event"] == "bf16_emulated"]
    found = [f.id for f in diagnose(tmp_path / "run").findings]
    if native:
        assert not warned and not slow and "bf16_emulated" not in found
        return
    assert len(warned) == 1 and "train.autocast_bf16=true, rollout.autocast_bf16=true" in warned[0]
    assert len(slow) == 1 and slow[0]["step"] == 1
    assert slow[0]["settings"] == ["train.autocast_bf16=true", "rollout.autocast_bf16=true"]
    assert slow[0]["cpu"]["capability"] == cpu.capability()
    assert "bf16_emulated" in found


def test_a_resumed_process_says_it_again_at_its_first_step(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "bf16_gemm_native", lambda: False)
    train(tiny_config("train.autocast_bf16=true", "checkpoint.every=1", steps=2), tmp_path / "run")
    train(tiny_config("train.autocast_bf16=true", "checkpoint.every=1", steps=3), tmp_path / "run", resume=True)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "bf16_emulated"] == [1, 3]
