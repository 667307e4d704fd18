"""``meshrl doctor`` on TRL's ``AsyncGRPOTrainer`` records (``trl.experimental.async_grpo``), constructed: the run is
recognised from its keys, its ``kl`` (against the sampler's log-probs) is judged as rollout/training mismatch and
never as KL to a reference, its ``sample/staleness_*`` as a lag that its clipped ratio corrects, its
``rewards/<name>`` as the accuracy; ``GRPOTrainer`` records are read as before."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_doctor import TH, records, write_events  # noqa: E402

from meshrl.doctor import TRL_NAMES, diagnose, diagnose_records  # noqa: E402
from meshrl.doctor.engines import (  # noqa: E402
    TRL_ASYNC_ACCURACY,
    TRL_ASYNC_CORRECTION,
    TRL_ASYNC_LOSS,
    TRL_ASYNC_NAMES,
    TRL_ASYNC_SAMPLE_KEYS,
    is_async_grpo,
    load_trl,
    trl_records,
)

N = 20


def async_history(n: int = N, *, kl=0.002, correct=None, reward=None, staleness: int = 2) -> list[dict]:
    """``log_history`` entries as AsyncGRPOTrainer writes them (a subset of its keys): ``kl``, ``correct`` and
    ``reward`` are constants or functions of the step; step s trains on samples min(s - 1, staleness) versions old."""
    def at(v, s):
        return v(s) if callable(v) else v

    rows = []
    for s in range(1, n + 1):
        age = float(min(s - 1, staleness))
        rows.append({"step": s, "epoch": s / n, "loss": 0.01, "grad_norm": 1.0, "learning_rate": 1e-6,
                     "reward": at(reward if reward is not None else (lambda k: 0.2 + 0.02 * k), s), "reward_std": 0.4,
                     "rewards/correct": at(correct if correct is not None else (lambda k: 0.1 + 0.02 * k), s),
                     "entropy": 0.8, "kl": at(kl, s), "ratio": 1.0, "clip_ratio/region_mean": 0.01,
                     "clip_ratio/low_mean": 0.005, "clip_ratio/high_mean": 0.005, "sample/staleness_mean": age,
                     "sample/staleness_max": age, "sample/time_in_queue_s": 0.5, "sample/rollout_queue_size": 3.0,
                     "batch/samples_per_step": 8.0})
    return rows


def grpo_history(n: int = N, *, kl=0.002) -> list[dict]:
    """GRPOTrainer's entries for the same run: ``rewards/<f>/mean`` and no sample stream."""
    rows = []
    for s in range(1, n + 1):
        rows.append({"step": s, "epoch": s / n, "loss": 0.01, "grad_norm": 1.0, "learning_rate": 1e-6,
                     "reward": 0.2 + 0.02 * s, "reward_std": 0.4, "rewards/correct/mean": 0.1 + 0.02 * s,
                     "rewards/correct/std": 0.3, "frac_reward_zero_std": 0.1, "entropy": 0.8,
                     "kl": kl(s) if callable(kl) else kl, "completions/mean_length": 40.0,
                     "completions/clipped_ratio": 0.0, "clip_ratio/region_mean": 0.01})
    return rows


def write_state(root: Path, history: list[dict]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "trainer_state.json").write_text(json.dumps({"max_steps": len(history), "log_history": history}))
    return root


def unchecked(diag) -> dict[str, str]:
    return {u.id: u.reason for u in diag.unchecked}


# ---------------------------------------------------------------------- the names, against TRL's source
def test_the_async_names_are_the_ones_async_grpo_trainer_logs_and_grpo_trainer_does_not():
    """Every key the async map reads is in TRL 1.16's async_grpo_trainer.py; the sample-stream keys that recognise
    the run are not in grpo_trainer.py; the loss keys are not what the asynchronous distillation trainer logs."""
    trl = pytest.importorskip("trl")
    root = Path(trl.__file__).parent
    async_src = (root / "experimental" / "async_grpo" / "async_grpo_trainer.py").read_text()
    grpo_src = (root / "trainer" / "grpo_trainer.py").read_text()
    for key in (*TRL_ASYNC_NAMES, *TRL_ASYNC_SAMPLE_KEYS, *TRL_ASYNC_LOSS):
        assert f'"{key}"' in async_src, key
    assert [k for k in TRL_ASYNC_SAMPLE_KEYS if k in grpo_src] == []
    assert '"ratio"' not in grpo_src  # GRPOTrainer logs no mean ratio
    distill = root / "experimental" / "async_distillation" / "async_distillation_trainer.py"
    if distill.is_file():
        assert [k for k in TRL_ASYNC_LOSS if f'["{k}"]' in distill.read_text()] == []
    # Its kl is the k3 estimate of the trainer's log-probs against the sampler's (old_log_probs), and it has no KL
    # term: AsyncGRPOConfig has no beta.
    assert "log_ratio = log_probs - old_log_probs" in async_src
    assert "local_kl_sum = ((coef_1 - 1) - log_ratio).sum()" in async_src
    config_src = (root / "experimental" / "async_grpo" / "async_grpo_config.py").read_text()
    assert not re.search(r"^\s+beta\s*:", config_src, re.MULTILINE)
    # A reward function's mean: rewards/<name> in the async worker, rewards/<name>/mean in GRPOTrainer.
    worker_src = (root / "experimental" / "async_grpo" / "async_rollout_worker.py").read_text()
    assert 'f"rewards/{name}": float(func_reward)' in worker_src
    assert 'f"rewards/{reward_func_name}/mean"' in grpo_src


def test_recognising_the_run():
    assert is_async_grpo(async_history(3))
    assert not is_async_grpo(grpo_history(3))
    assert not is_async_grpo([])
    # The asynchronous distillation trainer's sample stream without the clipped-ratio loss: not AsyncGRPOTrainer.
    assert not is_async_grpo([{"step": 1, "sample/staleness_mean": 1.0, "jsd": 0.3, "entropy": 0.9}])
    # A GRPOTrainer run's kl without any sample-stream key: not AsyncGRPOTrainer.
    assert not is_async_grpo([{"step": 1, "kl": 0.1, "ratio": 1.0}])
    assert TRL_ASYNC_ACCURACY.match("rewards/correct") and not TRL_ASYNC_ACCURACY.match("rewards/correct/mean")


# ---------------------------------------------------------------------- AsyncGRPOTrainer records
def test_a_large_async_kl_is_a_sampler_mismatch_not_a_kl_blowup(tmp_path):
    diag = diagnose(write_state(tmp_path / "async", async_history(kl=lambda s: 2.0 if s >= 10 else 0.002)))
    assert diag.engine == "trl"
    assert diag.mapping["kl"] == "mismatch/kl" and "kl/mean" not in diag.mapping.values()
    assert "kl_blowup" not in diag.ids() and "the recipe has no KL term" in unchecked(diag)["kl_blowup"]
    f = next(f for f in diag.findings if f.id == "rollout_mismatch")
    assert f.steps == list(range(10, 20)) and f.evidence["mismatch/kl"] == {"max": 2.0, "steps_over": 11,
                                                                            "limit": TH.mismatch_kl}
    assert any("AsyncGRPOTrainer records" in n and "max_staleness" in n for n in diag.notes)


def test_a_small_async_kl_passes_the_mismatch_check(tmp_path):
    diag = diagnose(write_state(tmp_path / "async", async_history(kl=0.002)))
    assert "rollout_mismatch" in diag.passed and diag.ids() == []


def test_the_reward_function_named_correct_is_the_accuracy(tmp_path):
    diag = diagnose(write_state(tmp_path / "async", async_history()))
    assert diag.mapping["rewards/correct"] == "acc/mean" and "reward_without_accuracy" in diag.passed
    # The reward rises while no answer is correct: read as accuracy, rewards/correct gives the finding.
    hacked = diagnose(write_state(tmp_path / "hacked", async_history(correct=0.0)))
    f = next(f for f in hacked.findings if f.id == "reward_without_accuracy")
    assert f.evidence["acc_max"] == 0.0
    # A reward function whose name says neither accuracy nor correctness is not the accuracy.
    other = [{("rewards/format" if k == "rewards/correct" else k): v for k, v in r.items()} for r in async_history()]
    rec = trl_records(tmp_path, other, {}, [])
    assert "rewards/format" not in rec.mapping and not rec.has("acc/mean") and rec.has("rewards/format")


def test_the_lag_is_read_and_counted_as_corrected(tmp_path):
    rec = load_trl(write_state(tmp_path / "async", async_history(staleness=3)))
    assert rec.mapping["sample/staleness_mean"] == "lag/staleness_mean"
    assert rec.mapping["sample/staleness_max"] == "lag/staleness_max"
    assert rec.series("lag/staleness_max")[1][:5] == [0.0, 1.0, 2.0, 3.0, 3.0]
    assert rec.has("sample/time_in_queue_s") and rec.has("sample/rollout_queue_size")  # kept under their names
    assert rec.config["staleness_correction"] == TRL_ASYNC_CORRECTION
    diag = diagnose_records(rec)
    assert "stale_rollouts" in diag.passed and "stale_rollouts" not in diag.ids()
    # Without the engine's marker the same lag would be called uncorrected: the marker is what makes it true.
    bare = diagnose_records(records(**{"lag__staleness_max": rec.series("lag/staleness_max")[1]}))
    assert "stale_rollouts" in bare.ids()


def test_the_marker_does_not_hide_a_failing_truncated_is_correction():
    """A run that logs rollout_corr/* is judged on it whatever corrects its lag besides."""
    lag = {"lag__staleness_max": [min(s, 2) for s in range(N)], "rollout_corr__ess": 0.2,
           "rollout_corr__frac_truncated": 0.0}
    plain, marked = records(**lag), records(config={"staleness_correction": TRL_ASYNC_CORRECTION}, **lag)
    assert diagnose_records(plain).ids() == diagnose_records(marked).ids() == ["stale_rollouts"]


def test_the_live_callbacks_input_reads_the_same_and_leaves_the_callers_config_alone(tmp_path):
    history = async_history(kl=lambda s: 2.0 if s >= 10 else 0.002)
    config = {"steps": N, "lr": 1e-6}
    live = trl_records(tmp_path, history, config, [])
    assert config == {"steps": N, "lr": 1e-6}
    post = load_trl(write_state(tmp_path / "async", history))
    assert live.steps == post.steps and live.mapping == post.mapping
    assert diagnose_records(live).ids() == diagnose_records(post).ids() == ["rollout_mismatch"]


def test_an_async_run_logged_to_tensorboard_only(tmp_path):
    rows = []
    for s in range(1, N + 1):
        rows += [(s, "train/reward", 0.3), (s, "train/kl", 2.0), (s, "train/entropy", 0.8),
                 (s, "train/sample/staleness_mean", 1.0), (s, "train/sample/staleness_max", 1.0),
                 (s, "train/rewards/correct", 0.2)]
    write_events(tmp_path / "tb" / "runs" / "x" / "events.out.tfevents.1.host", rows)
    diag = diagnose(tmp_path / "tb")
    assert diag.engine == "trl" and diag.mapping["kl"] == "mismatch/kl"
    assert diag.mapping["rewards/correct"] == "acc/mean" and diag.ids() == ["rollout_mismatch"]
    assert "stale_rollouts" in diag.passed


# ---------------------------------------------------------------------- GRPOTrainer records, unchanged
def test_grpo_trainer_records_are_read_as_before(tmp_path):
    diag = diagnose(write_state(tmp_path / "grpo", grpo_history(kl=lambda s: 2.0 if s >= 10 else 0.002)))
    assert diag.mapping["kl"] == "kl/mean" == TRL_NAMES["kl"]
    assert diag.mapping["rewards/correct/mean"] == "acc/mean" and "rewards/correct/std" not in diag.mapping
    assert "kl_blowup" in diag.ids() and "rollout_mismatch" not in diag.ids()
    assert "trl runs do not log meshrl's lagged rollouts" in unchecked(diag)["stale_rollouts"]
    assert not any("AsyncGRPOTrainer" in n for n in diag.notes)
    rec = load_trl(tmp_path / "grpo")
    assert "staleness_correction" not in rec.config
    # GRPOTrainer never logs rewards/<f> without /mean; such a key is not its accuracy.
    odd = [{**r, "rewards/correct": 0.5} for r in grpo_history()]
    assert "rewards/correct" not in trl_records(tmp_path, odd, {}, []).mapping
