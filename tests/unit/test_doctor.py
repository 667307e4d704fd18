"""``meshrl doctor`` on constructed records: every check at its documented thresholds, the reasons given for
what cannot be checked, the TRL and verl adapters (trainer_state.json, file-logger JSONL, TensorBoard events
read without TensorFlow), the grouping figures and the CLI."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from meshrl.cli import main as cli_main
from meshrl.doctor import DEFAULT, TRL_NAMES, VERL_NAMES, RunRecords, Thresholds, diagnose, diagnose_records
from meshrl.doctor.checks_data import is_garbled, nontext_share, repetition
from meshrl.doctor.grouping import grouping_metrics
from meshrl.doctor.tfevents import crc32c, masked_crc32c, read_scalars

TH = DEFAULT


def records(n: int = 20, samples: list | None = None, events: list | None = None, evals: list | None = None,
            config: dict | None = None, **series) -> RunRecords:
    """Records of ``n`` steps; each keyword is a metric: a constant, a list of n values or a function of the step."""
    steps = []
    for i in range(n):
        row = {"step": float(i + 1)}
        for key, v in series.items():
            val = v(i + 1) if callable(v) else v[i] if isinstance(v, list) else v
            if val is not None:
                row[key.replace("__", "/")] = float(val)
        steps.append(row)
    return RunRecords(path=Path("constructed"), engine="meshrl", steps=steps, samples=samples or [],
                      events=events or [], evals=evals or [], config=config or {})


def ids(rec: RunRecords, th: Thresholds = TH) -> list[str]:
    return diagnose_records(rec, th).ids()


# ---------------------------------------------------------------------- the checks at their thresholds
def test_reward_collapse_after_a_rise_and_whether_held_out_fell():
    curve = [0.1] * 4 + [0.6] * 8 + [0.15] * 8  # rise 0.5, gives back 0.45 (90%)
    evals = [{"step": 4.0, "eval/mean@1": 0.2}, {"step": 12.0, "eval/mean@1": 0.6}, {"step": 20.0, "eval/mean@1": 0.3}]
    diag = diagnose_records(records(reward__mean=curve, evals=evals))
    f = next(f for f in diag.findings if f.id == "reward_collapse")
    assert f.severity == "alarm" and f.evidence["eval_fell"] == "yes" and f.evidence["eval_best_step"] == 12
    assert f.steps == [6, 13]  # the smoothed (3-step) curve peaks at step 6 and is half way down at step 13
    # Half the rise given back is the threshold: 40% back is not a collapse; a rise under 0.1 is noise.
    assert "reward_collapse" not in ids(records(reward__mean=[0.1] * 4 + [0.6] * 8 + [0.4] * 8))
    assert "reward_collapse" not in ids(records(reward__mean=[0.1] * 4 + [0.19] * 8 + [0.1] * 8))
    no_eval = diagnose_records(records(reward__mean=curve)).findings[0]
    assert no_eval.evidence["eval_fell"].startswith("unknown") and no_eval.severity == "alarm"


def test_reward_collapse_is_a_warning_when_an_evaluation_after_the_fall_shows_no_fall():
    curve = [0.1] * 4 + [0.6] * 8 + [0.15] * 8  # falls (half way down) from step 13

    def finding(*accuracy_at: tuple[int, float]):
        evals = [{"step": float(step), "eval/mean@1": acc} for step, acc in accuracy_at]
        rec = records(reward__mean=curve, evals=evals)
        return next(f for f in diagnose_records(rec).findings if f.id == "reward_collapse")

    def severity(*accuracy_at: tuple[int, float]) -> str:
        return finding(*accuracy_at).severity

    # Held out after the fall and still at its best: the training reward's fall is not the model's.
    assert severity((4, 0.2), (12, 0.6), (20, 0.62)) == "warning"
    # Held out after the fall and fallen too: the run is broken.
    assert severity((4, 0.2), (12, 0.6), (20, 0.3)) == "alarm"
    # The last evaluation predates the fall: it has not seen it, so it cannot lift the alarm, and says so.
    assert severity((4, 0.2), (10, 0.62)) == "alarm"
    assert finding((4, 0.2), (10, 0.62)).what.endswith(
        "held-out accuracy was last evaluated at step 10, before the fall")
    # Evaluations are read by step, not file order, and a resumed run's repeated step keeps its later record.
    assert severity((4, 0.2), (20, 0.3), (16, 0.62)) == "alarm"
    assert severity((4, 0.2), (12, 0.6), (20, 0.3), (20, 0.62)) == "warning"
    # One evaluation is no evidence either way.
    assert severity((20, 0.62)) == "alarm"


def test_held_out_bookkeeping_is_not_read_as_a_score():
    curve = [0.1] * 4 + [0.6] * 8 + [0.15] * 8
    evals = [{"step": float(s), "eval/reward_errors": 0.0, "eval/skipped_long_prompts": 0.0} for s in (4, 12, 20)]
    f = next(f for f in diagnose_records(records(reward__mean=curve, evals=evals)).findings
             if f.id == "reward_collapse")
    assert f.severity == "alarm" and f.evidence["eval_fell"].startswith("unknown")


def test_entropy_collapse_explosion_and_the_solved_exception():
    fast = [2.0 * 0.8 ** i for i in range(20)]  # last window 0.04, first 1.48: under 0.1x
    slow = [2.0 * 0.9 ** i for i in range(20)]  # last window 0.32, first 1.72: 0.18x, not a collapse
    assert "entropy_collapse" not in ids(records(entropy__mean=slow, reward__mean=0.3))
    f = next(f for f in diagnose_records(records(entropy__mean=fast, reward__mean=0.3)).findings
             if f.id == "entropy_collapse")
    assert f.severity == "warning" and f.steps == [13]  # 2 * 0.8^12 = 0.137 < 0.1 x 1.476 first at step 13
    solved = diagnose_records(records(entropy__mean=fast, reward__mean=[0.3] * 4 + [0.99] * 16))
    assert next(f for f in solved.findings if f.id == "entropy_collapse").severity == "info"
    rising = [1.0] * 4 + [1.0 + 0.2 * i for i in range(16)]  # ends at 4.0 nats, 4x the start, no single jump
    f = next(f for f in diagnose_records(records(entropy__mean=rising, reward__mean=0.2)).findings
             if f.id == "entropy_explosion")
    assert f.severity == "alarm" and f.steps == [11]  # 1 + 0.2 * (11 - 5) = 2.2: first step above 2x
    assert "entropy_explosion" not in ids(records(entropy__mean=[1.0] * 4 + [1.9] * 16, reward__mean=0.2))


def test_one_update_that_wrecks_the_policy():
    ent = [4.5, 4.4, 0.3] + [0.2] * 17
    f = diagnose_records(records(entropy__mean=ent, reward__mean=0.05)).findings[0]
    assert f.id == "update_blowup" and f.steps == [3]
    assert any(x.startswith("entropy_collapse") for x in f.evidence["also"])
    # The same jump while the task gets solved is learning.
    assert "update_blowup" not in ids(records(entropy__mean=ent, reward__mean=[0.05] * 3 + [0.99] * 17))


def test_length_blowup_and_collapse_need_a_3x_change_of_at_least_2_tokens():
    assert ids(records(len__response_mean=[10] * 4 + [31] * 16)) == ["length_blowup"]
    assert ids(records(len__response_mean=[10] * 4 + [29] * 16)) == []
    assert ids(records(len__response_mean=[30] * 4 + [9] * 16)) == ["length_collapse"]
    assert ids(records(len__response_mean=[1.5] * 4 + [0.4] * 16)) == []  # 1.1 tokens: too small to matter


def test_kl_ratio_tail_and_clipped_share():
    assert ids(records(kl__mean=[0.01] * 19 + [1.2])) == ["kl_blowup"]
    assert ids(records(kl__mean=[0.01] * 4 + [0.2] * 16)) == ["kl_blowup"]  # grew 20x past kl_max / 10
    assert ids(records(kl__mean=[0.01] * 4 + [0.05] * 16)) == []
    diag = diagnose_records(records(ratio__max=[1.2] * 10 + [12.0] + [1.3] * 9, ratio__mean=1.0))
    f = diag.findings[0]
    assert f.id == "ratio_tail" and f.steps == [11] and f.evidence["ratio/max"]["worst"] == 12.0
    assert ids(records(ratio__max=9.9, ratio__mean=1.0)) == []  # mean is fine, the tail is what is checked
    assert ids(records(clip__frac=[0.05] * 19 + [0.35])) == ["ratio_tail"]


def test_gradient_spikes_against_the_running_median():
    norms = [1.0] * 10 + [10.5] + [1.0] * 9
    f = diagnose_records(records(grad__norm=norms)).findings[0]
    assert f.id == "grad_spike" and f.steps == [11]
    assert ids(records(grad__norm=[1.0] * 10 + [9.5] + [1.0] * 9)) == []
    assert ids(records(grad__norm=[1.0] * 10 + [9.5] + [1.0] * 9), replace(TH, grad_spike_factor=5)) == ["grad_spike"]


def test_nonfinite_steps_from_metrics_and_events():
    rec = records(loss__total=1.0)
    rec.steps[6]["loss/total"] = math.nan
    rec.events = [{"step": 9, "event": "nonfinite_skip"}]
    f = diagnose_records(rec).findings[0]
    assert f.id == "nonfinite" and f.steps == [7, 9] and f.severity == "alarm"


def test_stall_and_learning_rate_mistakes():
    assert ids(records(reward__mean=0.3, adv__abs_mean=0.01)) == ["stall"]
    assert ids(records(reward__mean=0.3, adv__abs_mean=0.4)) == []
    assert ids(records(lr=0.0)) == ["lr_schedule"]
    assert ids(records(lr=1e-6, config={"warmup_steps": 50, "steps": 20})) == ["lr_schedule"]
    assert ids(records(lr=1e-6, config={"warmup_steps": 5, "steps": 20})) == []


def test_bf16_emulated_from_the_trainers_event():
    event = {"step": 3, "event": "bf16_emulated", "settings": ["train.autocast_bf16=true", "train.dtype=bfloat16"],
             "cpu": {"model": "AMD EPYC", "capability": "AVX2"}}
    rec = records(time__step_s=lambda s: 9.0 if s < 3 else 500.0 + s, events=[event])
    f = diagnose_records(rec).findings[0]
    assert f.id == "bf16_emulated" and f.severity == "warning" and f.steps == [3]
    assert f.evidence["median_step_s"] == 511.5  # steps 3..20
    assert "AVX2" in f.what and "train.autocast_bf16=false" in f.knob and "train.dtype=float32" in f.knob
    assert ids(records(time__step_s=9.0)) == []
    rec.engine = "trl"
    assert "bf16_emulated" in [u.id for u in diagnose_records(rec).unchecked]


def test_flat_groups_and_broken_grouping():
    assert ids(records(group__flat_frac=[0.9] * 10 + [0.2] * 10)) == ["no_learning_signal"]  # half the steps
    assert ids(records(group__flat_frac=[0.9] * 9 + [0.2] * 11)) == []
    broken = diagnose_records(records(group__flat_frac=1.0, group__size1_frac=1.0, group__split_arm_frac=1.0,
                                      group__mixed_problem_frac=0.0))
    assert broken.ids() == ["broken_grouping"]  # the flat groups are its consequence
    assert any(x.startswith("no_learning_signal") for x in broken.findings[0].evidence["also"])
    assert ids(records(n=3, config={"group_size": 1})) == ["broken_grouping"]


def test_grouping_metrics_by_hand():
    # Two prompts (q0, q1) of 3 rollouts; q1's third rollout carries a stray id shared with nothing.
    out = grouping_metrics(["a", "a", "a", "b", "b", "c"], [0, 0, 0, 1, 1, 1], [-1] * 6,
                           ["p0", "p0", "p0", "p1", "p1", "p1"], [1, 0, 1, 0.5, 0.5, 1], [0.5, -1, 0.5, 0, 0, 0])
    assert out["group/count"] == 3 and out["group/size_min"] == 1 and out["group/size1_frac"] == pytest.approx(1 / 3)
    assert out["group/split_arm_frac"] == 0.5 and out["group/mixed_problem_frac"] == 0
    assert out["group/flat_frac"] == pytest.approx(2 / 3) and out["adv/zero_frac"] == 0.5
    mixed = grouping_metrics([7, 7], [0, 1], [-1, -1], ["p0", "p1"], [0, 1], [-1, 1])
    assert mixed["group/mixed_problem_frac"] == 1.0
    with pytest.raises(ValueError, match="one entry per rollout"):
        grouping_metrics([1, 2], [0], [-1, -1], ["a", "b"], [0, 1], [0, 0])


def test_strategy_collapse_first_crossing_and_lag_to_accuracy_fall():
    mass = [0.5] * 5 + [0.95] * 15
    acc = [0.5] * 8 + [0.3] * 12
    f = diagnose_records(records(strategy__problem_max_mass=mass, acc__mean=acc)).findings[0]
    assert f.id == "strategy_collapse" and f.severity == "warning"
    assert f.evidence["first_crossing"] == {"strategy/problem_max_mass": 6}
    # acc/mean smoothed over 3 steps is 0.433 at step 8: 0.067 below its best, past eval_drop_min = 0.05.
    assert f.evidence["accuracy_fall_step"] == 8 and f.evidence["lag_steps"] == 2
    mei = records(mei__query=[1.0] * 10 + [3.0] * 10, acc__mean=0.5, config={"mei_threshold": 2.0})
    f = diagnose_records(mei).findings[0]
    assert f.evidence["first_crossing"] == {"mei/query": 11} and f.severity == "info"


def test_metrics_logged_only_as_nan_do_not_crash_the_checks():
    """A metric present on every step but never finite (an engine logging NaN) used to crash the whole
    diagnosis (fmean of nothing, [-1] of an empty series) in the learning-signal and strategy checks."""
    nan = float("nan")
    rec = records(group__flat_frac=1.0, reward__mean=0.5, reward__std=nan, mei__query=[1.0] * 10 + [3.0] * 10,
                  mei__effective_dirs_median=nan, acc__mean=0.5, config={"mei_threshold": 2.0})
    diag = diagnose_records(rec, TH)
    signal = next(f for f in diag.findings if f.id == "no_learning_signal")
    assert signal.evidence["reward_std_mean"] is None
    strategy = next(f for f in diag.findings if f.id == "strategy_collapse")
    assert "mei/effective_dirs_median" not in strategy.evidence
    emptied = records(rollouts__kept=0.0, reward__mean=0.0)  # nothing sampled, nothing kept: nothing to judge
    assert "no_learning_signal" in [u.id for u in diagnose_records(emptied, TH).unchecked]


def test_reward_errors_and_parser_failures_from_samples():
    assert ids(records(reward__errors=[0] * 19 + [20], rollouts__count=16)) == ["reward_errors"]  # 20/320 > 5%
    assert ids(records(reward__errors=[0] * 19 + [10], rollouts__count=16)) == []
    samples = [{"step": s, "completion": "I think it is seven", "score": 0.0, "truncated": s % 4 == 0}
               for s in range(1, 21)]
    samples += [{"step": s, "completion": "so \\boxed{7}", "score": 1.0} for s in range(1, 21, 3)]
    f = diagnose_records(records(samples=samples, config={"reward_kind": "number"})).findings[0]
    assert f.id == "parser_failure" and f.evidence["no_answer_share"] > 0.5 and f.evidence["wrong_answer_share"] == 0
    assert f.evidence["no_answer_truncated_share"] == 0.25 and "ended on their own" in f.what
    answered = [{"step": s, "completion": "\\boxed{8}", "score": 0.0} for s in range(1, 21)]
    assert ids(records(samples=answered, config={"reward_kind": "number"})) == []  # wrong answers, parsed fine


def test_garbled_text_measures_and_check():
    assert repetition("aaaab") == (4, 1.0) and repetition("abababab") == (1, 0.4)
    assert nontext_share("ab\x00\ufffd") == 0.5 and nontext_share("line\nnext\t") == 0.0
    assert is_garbled("the the the the the the the the", TH) and not is_garbled("aaaaaaaaaaaa", TH)  # too short
    assert not is_garbled("A plain sentence that answers the question.", TH)
    bad = [{"step": s, "completion": "x" * 30} for s in range(15, 21)]
    good = [{"step": s, "completion": "A plain sentence that answers it."} for s in range(1, 15)]
    f = diagnose_records(records(samples=good + bad)).findings[0]
    assert f.id == "garbled_output" and f.evidence["longest_char_run"] == 30 and f.samples


def test_truncation_rising_is_a_warning_constant_is_info():
    rising = diagnose_records(records(len__truncated_frac=[0.1] * 4 + [0.8] * 16, config={"max_new_tokens": 64}))
    assert [(f.id, f.severity) for f in rising.findings] == [("truncation", "warning")]
    constant = diagnose_records(records(len__truncated_frac=1.0, len__response_mean=4.0, config={"max_new_tokens": 4}))
    assert [(f.id, f.severity) for f in constant.findings] == [("truncation", "info")]
    assert constant.findings[0].evidence["pinned_at_cap"] is True


def test_what_cannot_be_checked_is_said_with_the_missing_metric():
    diag = diagnose_records(records(n=3, reward__mean=0.1))
    reasons = {u.id: u.reason for u in diag.unchecked}
    assert "'reward/mean' is logged on 3 step(s); the check needs 5" in reasons["reward_collapse"]
    assert "'entropy/mean'" in reasons["entropy"] and "'grad/norm'" in reasons["grad_spike"]
    assert "samples" in reasons["garbled_output"] and "group/*" in reasons["broken_grouping"]
    assert diag.findings == []


def test_thresholds_overrides_and_cli_errors(tmp_path, capsys):
    assert Thresholds().with_overrides({"grad_spike_factor": "5"}).grad_spike_factor == 5.0
    with pytest.raises(ValueError, match="unknown doctor threshold"):
        Thresholds().with_overrides({"nope": 1})
    assert cli_main(["doctor", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli_main(["doctor", str(tmp_path)]) == 2
    assert "not a meshrl run" in capsys.readouterr().err


# ---------------------------------------------------------------------- TensorBoard events by hand
def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, wire: int, payload: bytes) -> bytes:
    head = _varint(number << 3 | wire)
    return head + (_varint(len(payload)) + payload if wire == 2 else payload)


def _event(step: int, tag: str, value: float, *, tensor: bool = False) -> bytes:
    if tensor:  # TensorProto dtype=DT_FLOAT, float_val packed
        scalar = _field(8, 2, _field(1, 0, _varint(1)) + _field(5, 2, struct.pack("<f", value)))
    else:
        scalar = _field(2, 5, struct.pack("<f", value))
    summary = _field(1, 2, _field(1, 2, tag.encode()) + scalar)
    return _field(1, 1, struct.pack("<d", 1.7e9)) + _field(2, 0, _varint(step)) + _field(5, 2, summary)


def _record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def write_events(path: Path, rows: list[tuple[int, str, float]], *, tensor_tags: tuple[str, ...] = (),
                 tail: bytes = b"") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = _record(_field(1, 1, struct.pack("<d", 1.7e9)) + _field(3, 2, b"brain.Event:2"))
    blob += b"".join(_record(_event(s, t, v, tensor=t in tensor_tags)) for s, t, v in rows)
    path.write_bytes(blob + tail)
    return path


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value


def test_event_reader_simple_and_tensor_scalars_and_a_cut_record(tmp_path):
    path = write_events(tmp_path / "events.out.tfevents.1.host", [(1, "a", 0.5), (2, "b", 1.25)], tensor_tags=("b",),
                        tail=struct.pack("<Q", 99) + b"\x00" * 6)
    problems: list[str] = []
    got = [(e.step, e.tag, e.value) for e in read_scalars(path, problems)]
    assert got == [(1, "a", 0.5), (2, "b", 1.25)]
    assert problems and "header" in problems[0]
    corrupt = bytearray(path.read_bytes())
    corrupt[8] ^= 0xFF  # the first record's header CRC
    (tmp_path / "bad").mkdir()
    bad = tmp_path / "bad" / "events.out.tfevents.2"
    bad.write_bytes(bytes(corrupt))
    problems = []
    assert read_scalars(bad, problems) == [] and "CRC" in problems[0]


# ---------------------------------------------------------------------- TRL
def _trl_history(n: int = 20) -> list[dict]:
    rows = []
    for s in range(1, n + 1):
        reward = 0.2 if s <= 4 else 0.8 if s <= 12 else 0.25
        rows.append({"step": s, "epoch": s / n, "loss": 0.01, "grad_norm": 1.0, "learning_rate": 1e-6,
                     "reward": reward, "reward_std": 0.3, "rewards/accuracy_reward/mean": reward,
                     "frac_reward_zero_std": 0.1, "entropy": 0.8, "completions/mean_length": 120.0,
                     "completions/clipped_ratio": 0.02, "clip_ratio/region_mean": 0.01,
                     "sampling/sampling_logp_difference/max": 2.5 if s == 15 else 0.1})
        if s % 5 == 0:
            rows.append({"step": s, "eval_reward": 0.7 if s <= 10 else 0.4, "eval_loss": 0.1})
    return rows


def test_trl_trainer_state_is_mapped_and_diagnosed(tmp_path):
    ckpt = tmp_path / "trl_out" / "checkpoint-20"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"max_steps": 20, "log_history": _trl_history()}))
    (tmp_path / "trl_out" / "training_args.json").write_text(json.dumps(
        {"max_completion_length": 256, "num_generations": 8, "learning_rate": 1e-6, "warmup_steps": 0}))
    diag = diagnose(tmp_path / "trl_out")
    assert diag.engine == "trl" and diag.steps_logged == 20
    assert diag.mapping["rewards/accuracy_reward/mean"] == "acc/mean"
    assert {diag.mapping[k] for k in ("reward", "entropy", "grad_norm", "frac_reward_zero_std")} == {
        "reward/mean", "entropy/mean", "grad/norm", "group/flat_frac"}
    found = {f.id: f for f in diag.findings}
    assert set(found) == {"reward_collapse", "rollout_mismatch"}
    assert found["reward_collapse"].evidence["eval_key"] == "eval/reward"
    assert found["reward_collapse"].evidence["eval_fell"] == "yes"
    assert found["rollout_mismatch"].steps == [15]
    assert "no logged completions" in {u.id: u.reason for u in diag.unchecked}["garbled_output"]


def test_trl_tensorboard_only(tmp_path):
    rows = []
    for s in range(1, 21):
        rows += [(s, "train/reward", 0.3), (s, "train/entropy", 0.8), (s, "train/grad_norm", 50.0 if s == 12 else 1.0),
                 (s, "train/learning_rate", 1e-6)]
    write_events(tmp_path / "trl_tb" / "runs" / "x" / "events.out.tfevents.1.host", rows)
    diag = diagnose(tmp_path / "trl_tb")
    assert diag.engine == "trl" and diag.ids() == ["grad_spike"] and diag.findings[0].steps == [12]


def test_trl_names_are_the_ones_trl_logs():
    """Every mapped TRL key is a metric name that TRL 1.16's GRPOTrainer or transformers' Trainer writes."""
    trl = pytest.importorskip("trl")
    source = (Path(trl.__file__).parent / "trainer" / "grpo_trainer.py").read_text()
    hf = {"loss", "grad_norm", "learning_rate"}
    missing = [k for k in TRL_NAMES if k not in hf and f'"{k}"' not in source]
    assert not missing, missing


# ---------------------------------------------------------------------- verl
def test_verl_file_logger_is_mapped_and_diagnosed(tmp_path):
    lines = []
    for s in range(1, 21):
        data = {"critic/score/mean": 0.4, "actor/entropy": 0.6 if s <= 4 else 0.6 + 0.15 * (s - 4),
                "response_length/mean": 300.0, "response_length/clip_ratio": 0.01, "actor/grad_norm": 0.5,
                "actor/lr": 1e-6, "actor/pg_clipfrac": 0.01, "rollout_corr/kl": 0.05 if s > 15 else 0.001}
        if s % 10 == 0:
            data["val-core/gsm8k/acc/mean@1"] = 0.5
        lines.append(json.dumps({"step": s, "elapsed_seconds": 1.0 * s, "data": data}))
    (tmp_path / "verl").mkdir()
    (tmp_path / "verl" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    diag = diagnose(tmp_path / "verl")
    assert diag.engine == "verl"
    assert diag.mapping["actor/entropy"] == "entropy/mean" and diag.mapping["rollout_corr/kl"] == "mismatch/kl"
    assert set(diag.ids()) == {"entropy_explosion", "rollout_mismatch"}
    explosion = next(f for f in diag.findings if f.id == "entropy_explosion")
    assert explosion.steps == [9]  # 0.6 + 0.15 * 5 = 1.35 > 2 x 0.6 first at step 9


def test_verl_tensorboard_events(tmp_path):
    rows = [(s, "critic/score/mean", 0.3) for s in range(1, 21)]
    rows += [(s, "actor/kl_loss", 0.01 if s < 20 else 2.0) for s in range(1, 21)]
    write_events(tmp_path / "verl_tb" / "events.out.tfevents.3.host", rows)
    diag = diagnose(tmp_path / "verl_tb")
    assert diag.engine == "verl" and diag.ids() == ["kl_blowup"]
    assert set(VERL_NAMES.values()) >= {"reward/mean", "entropy/mean", "grad/norm", "len/truncated_frac"}


def test_cli_text_json_and_fail_on(tmp_path, capsys):
    (tmp_path / "verl.jsonl").write_text("".join(json.dumps({"step": s, "data": {
        "critic/score/mean": 0.3, "actor/grad_norm": 1.0 if s != 10 else 40.0}}) + "\n" for s in range(1, 21)))
    assert cli_main(["doctor", str(tmp_path / "verl.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "Gradient-norm spikes (grad_spike) at step(s) 10" in text and "knob:" in text and "not checked:" in text
    assert cli_main(["doctor", str(tmp_path / "verl.jsonl"), "--fail-on", "warning", "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["findings"][0]["id"] == "grad_spike" and out["engine"] == "verl"
    assert cli_main(["doctor", str(tmp_path / "verl.jsonl"), "--set", "grad_spike_factor=50"]) == 0
    assert "grad_spike" not in capsys.readouterr().out.split("not checked:")[0]
    assert cli_main(["doctor", str(tmp_path / "verl.jsonl"), "--set", "bogus=1"]) == 2
    assert cli_main(["doctor", str(tmp_path / "verl.jsonl"), "--html", str(tmp_path / "page")]) == 0
    page = (tmp_path / "page" / "index.html").read_text()
    assert '<section id="diagnosis">' in page and 'data-finding="grad_spike"' in page


def test_json_has_no_nan_and_text_names_every_part():
    from meshrl.doctor import render_text

    samples = [{"step": s, "completion": "no answer here", "score": 0.0} for s in range(1, 21)]
    diag = diagnose_records(records(samples=samples, config={"reward_kind": "number"}))
    f = diag.findings[0]
    assert f.id == "parser_failure" and math.isnan(f.evidence["wrong_answer_share"])  # nothing was parsed
    out = json.dumps(diag.to_dict(), allow_nan=False)
    assert json.loads(out)["findings"][0]["evidence"]["wrong_answer_share"] == "nan"
    text = render_text(diag)
    for part in ("[alarm] Reward-parser failures (parser_failure) at step(s)", "evidence:", "sample [step",
                 "knob:", "not checked:", "confidence"):
        assert part in text, part


def test_reward_collapse_whose_last_dip_the_smoothing_flattens_is_dated_at_the_last_step():
    """The smoothed curve can stay above the half-way mark after the peak while the raw last window is below it:
    the fall is then dated at the last step (this once raised StopIteration and stopped a live run)."""
    curve = [1, 0, 1, 0, 0, 1, 1, 0, 1, .5, 1, .5, 1, .5, 0, 1, 0, 1, 1, 1]
    diag = diagnose_records(records(reward__mean=curve), replace(TH, collapse_drop_frac=0.1))
    assert all("failed" not in u.reason for u in diag.unchecked)


def test_a_check_that_raises_is_reported_not_fatal(monkeypatch, caplog):
    import importlib

    dg = importlib.import_module("meshrl.doctor.diagnose")  # the module, not the function of that name

    def broken(rec, th):
        raise StopIteration

    ids_, _ = dg.CHECKS[0]
    monkeypatch.setattr(dg, "CHECKS", [(ids_, broken), *dg.CHECKS[1:]])
    diag = diagnose_records(records(reward__mean=0.5))
    reason = next(u.reason for u in diag.unchecked if u.id == ids_[0])
    assert reason.startswith("the check failed (StopIteration") and "check broken failed" in caplog.text
