"""meshrl.rollout.choice: which sampler ``rollout.backend=auto`` builds (device, vLLM present or not, step shape)."""

from __future__ import annotations

import logging

import pytest

from meshrl.rollout import choice
from meshrl.rollout.choice import (
    CPU_MEASURED,
    GPU_VLLM_MIN_TOKENS,
    StepShape,
    choose_sampler,
    log_once,
    nearest_measured,
)

# A made-up table where vLLM wins the long shape only: the rule must follow the table, whatever it holds.
SPLIT = {StepShape(64, 64): (200.0, 150.0), StepShape(16, 512): (90.0, 120.0)}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("shape", [None, StepShape(64, 64), StepShape(16, 512), StepShape(256, 4096)])
def test_without_vllm_it_is_always_native(device, shape):
    assert choose_sampler(device=device, vllm_available=False, shape=shape, cpu_measured=SPLIT)[0] == "native"


def test_an_unknown_shape_stays_native_even_with_vllm():
    name, why = choose_sampler(device="cuda", vllm_available=True, shape=None)
    assert name == "native" and "shape is not known" in why


def test_cpu_follows_the_measured_table_by_the_nearest_shape():
    def pick(seqs: int, tokens: int) -> str:
        return choose_sampler(device="cpu", vllm_available=True, shape=StepShape(seqs, tokens), cpu_measured=SPLIT)[0]

    assert pick(64, 64) == "native" and pick(16, 512) == "vllm"
    assert pick(128, 32) == "native" and pick(8, 1024) == "vllm"  # beyond the measured corners
    assert pick(32, 256) == "vllm"  # log-distance 0.98 to 16x512 against 1.47 to 64x64
    assert nearest_measured(StepShape(64, 128), SPLIT) == StepShape(64, 64)


def test_cpu_where_native_wins_everywhere_names_the_figures():
    native_wins = {StepShape(64, 64): (200.0, 150.0), StepShape(16, 512): (130.0, 120.0)}
    name, why = choose_sampler(device="cpu", vllm_available=True, shape=StepShape(16, 512), cpu_measured=native_wins)
    assert name == "native"
    assert why == ("vllm installed, but at 16x512, the measured shape nearest the step's 16x512, the native decoder "
                   "measured >= vLLM's CPU build (130 vs 120 tokens/s; benchmarks/README.md)")


def test_the_shipped_cpu_table_keeps_native_at_every_measured_shape():
    """Measured with prepacked decode GEMMs: native ahead at 64x64 and 16x512 (benchmarks/README.md)."""
    assert set(CPU_MEASURED) == {StepShape(64, 64), StepShape(16, 512)}
    assert all(native > vllm > 0 for native, vllm in CPU_MEASURED.values())
    assert choose_sampler(device="cpu", vllm_available=True, shape=StepShape(64, 64))[0] == "native"
    name, why = choose_sampler(device="cpu", vllm_available=True, shape=StepShape(8, 1024))
    assert name == "native" and "at 16x512" in why and "242 vs 187 tokens/s" in why


def test_gpu_picks_vllm_for_large_steps_only():
    big = StepShape(64, GPU_VLLM_MIN_TOKENS // 64)
    small = StepShape(64, GPU_VLLM_MIN_TOKENS // 64 - 1)
    assert choose_sampler(device="cuda", vllm_available=True, shape=big)[0] == "vllm"
    name, why = choose_sampler(device="cuda", vllm_available=True, shape=small)
    assert name == "native" and str(small) in why


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="sequences >= 1"):
        StepShape(0, 64)


def test_log_once_logs_a_message_once(monkeypatch, caplog):
    monkeypatch.setattr(choice, "_logged", set())
    with caplog.at_level(logging.INFO, logger="meshrl"):
        for _ in range(3):
            log_once("rollout backend auto -> native: %s", "why")
    assert [r.getMessage() for r in caplog.records] == ["rollout backend auto -> native: why"]
