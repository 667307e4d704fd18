"""``meshrl train ... --set rollout.backend=vllm`` on vLLM's CPU build, and a resumed run that samples from the
restored weights (run in .venv-vllm by scripts/vllm_env.sh; skipped where vLLM is not installed)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm_probe import MATCH_TOL, MOVED_MIN, SEQUENCE, engine_logprobs, policy_logprobs  # noqa: E402

from meshrl.cli import main as cli_main  # noqa: E402
from meshrl.jsonl import read_jsonl  # noqa: E402
from meshrl.runs.run_dir import prepare_resume  # noqa: E402
from meshrl.trainer import (  # noqa: E402
    Trainer,  # noqa: E402
    load_config,
    train,
)

# tiny:small, not tiny: vLLM's CPU attention takes head size 32, not 16.
FAST = [
    "model=tiny:small", "task=tiny:repeat", "rollout.backend=vllm", "rollout.prompts_per_step=2",
    "rollout.group_size=4", "rollout.max_new_tokens=6", "train.micro_batch_size=8", "log.progress=false",
    "checkpoint.every=1", "optim.lr=1e-2", "train.update_workers=1",
]


def test_cli_train_runs_steps_with_the_vllm_backend(tmp_path, caplog):
    run = tmp_path / "run"
    args = ["train", "--steps", "2", "--out", str(run), "--no-progress"]
    for item in FAST:
        args += ["--set", item]
    with caplog.at_level("INFO"):
        assert cli_main(args) in (0, None)
    assert "rollout backend: vllm" in caplog.text
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # The sampler's log-probs reached the trainer and the mismatch diagnostic compared them with the update's on
    # the same float32 weights (synced after step 1): float noise, not the gap of a stale or bf16 sampler.
    assert all(r["mismatch/logp_absdiff_max"] < MATCH_TOL for r in rows), [r["mismatch/logp_absdiff_max"]
                                                                           for r in rows]


def test_resumed_run_samples_from_the_restored_weights(tmp_path):
    run = tmp_path / "run"
    train(load_config(overrides=[*FAST, "steps=2"]), run)
    cfg = load_config(overrides=[*FAST, "steps=3"])
    prepare_resume(run)
    trainer = Trainer(cfg, run)
    try:
        fresh = policy_logprobs(trainer.model, SEQUENCE)
        assert torch.allclose(engine_logprobs(trainer.backend, SEQUENCE), fresh, atol=MATCH_TOL)
        trainer.restore()
        restored = policy_logprobs(trainer.model, SEQUENCE)
        assert (restored - fresh).abs().max() > MOVED_MIN  # two steps at lr 1e-2 moved the policy
        assert torch.allclose(engine_logprobs(trainer.backend, SEQUENCE), restored, atol=MATCH_TOL)
    finally:
        trainer.close()


def test_top_p_mismatch_and_importance_ratio_compare_like_with_like(tmp_path):
    """At top_p 0.9 vLLM's processed log-probs are under the truncated distribution; the trainer adds back the
    log kept mass, so on the same weights the mismatch is float noise and the correction's weight is 1, not
    1 / kept mass (the bias it would carry if the two were compared as they come)."""
    run = tmp_path / "run"
    cfg = load_config(overrides=[*FAST, "steps=2", "rollout.top_p=0.9", "rollout.max_new_tokens=8",
                                 "plugins.rollout_corr.enabled=true"])
    train(cfg, run)
    rows = read_jsonl(run / "metrics.jsonl")
    assert all(r["mismatch/logp_absdiff_max"] < MATCH_TOL for r in rows), rows
    assert all(abs(r["rollout_corr/weight_mean"] - 1) < MATCH_TOL for r in rows), rows


def test_without_the_kept_mass_top_p_shows_as_mismatch(tmp_path, monkeypatch):
    """The control: with the kept mass left out, the same run reports the truncation as mismatch (the test
    above can fail)."""
    from meshrl.rollout.vllm_backend import VLLMBackend

    monkeypatch.setattr(VLLMBackend, "logprobs_truncated", property(lambda self: False))
    run = tmp_path / "run"
    cfg = load_config(overrides=[*FAST, "steps=1", "rollout.top_p=0.9", "rollout.max_new_tokens=8",
                                 "plugins.rollout_corr.enabled=true"])
    train(cfg, run)
    (row,) = read_jsonl(run / "metrics.jsonl")
    assert row["mismatch/logp_absdiff_max"] > 10 * MATCH_TOL
    assert row["rollout_corr/weight_mean"] < 1 - MATCH_TOL
