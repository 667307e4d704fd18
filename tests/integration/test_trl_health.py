"""``HealthCallback`` in a TRL GRPO run (tiny offline model, CPU): the verdict at every checked step equals
``meshrl doctor`` on the run's ``trainer_state.json`` cut at that step; ``stop`` ends the run without saving the
unhealthy step, the last healthy checkpoint on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from meshrl.doctor import diagnose_records  # noqa: E402
from meshrl.doctor.engines import load_trl  # noqa: E402
from meshrl.doctor.live import truncate_records  # noqa: E402
from meshrl.integrations.trl import HealthCallback  # noqa: E402
from meshrl.jsonl import read_jsonl  # noqa: E402
from meshrl.models.tiny import build_tiny  # noqa: E402


def even_length(completions, **kwargs) -> list[float]:
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(t) % 2 == 0) for t in texts]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    model, tok = build_tiny("tiny", seed=0)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


def run(model_dir: Path, out: Path, callback: HealthCallback, steps: int, *, attach: bool = False,
        **kw) -> GRPOTrainer:
    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=6, max_steps=steps, logging_steps=1, report_to=[],
                      seed=0, learning_rate=1.0, save_strategy="no", **kw)  # lr 1.0 wrecks the policy at once
    rows = [{"prompt": f"{a} + {b} ="} for a in range(4) for b in range(4)]
    from transformers import AutoTokenizer

    trainer = GRPOTrainer(str(model_dir), even_length, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(model_dir),
                          callbacks=[] if attach else [callback])
    if attach:
        callback.attach(trainer)
    trainer.train()
    trainer.save_state()
    return trainer


def test_live_verdicts_equal_the_doctor_on_the_log_cut_there(model_dir, tmp_path):
    out = tmp_path / "out"
    run(model_dir, out, HealthCallback(every=1), steps=8)
    checks = [e for e in read_jsonl(out / "health_events.jsonl") if e["event"] == "health_check"]
    assert [c["step"] for c in checks] == list(range(1, 9))
    assert json.loads((out / "training_args.json").read_text())["num_generations"] == 4
    rec = load_trl(out)  # reads training_args.json as the live checks saw it
    for check in checks:
        post = diagnose_records(truncate_records(rec, check["step"]))
        assert check["findings"] == [f.id for f in post.findings], check["step"]
    assert any(c["findings"] for c in checks)  # lr 1.0 does go wrong, and the checks say so


def test_attached_it_reads_the_completions_the_doctor_reads_afterwards(model_dir, tmp_path):
    """Attached, the callback takes each step's completions from the trainer: the rows log_completions writes to
    completions/*.parquet, which the post-hoc doctor reads; the garbled-output check runs on them."""
    pytest.importorskip("pyarrow")
    out = tmp_path / "out"
    cb = HealthCallback(every=1)
    run(model_dir, out, cb, steps=6, attach=True, log_completions=True)
    rec = load_trl(out)
    assert len(rec.samples) == 6 * 8 and {s["step"] for s in rec.samples} == set(range(1, 7))
    assert [(s["step"], s["completion"], s.get("reward")) for s in cb.samples] == \
        [(s["step"], s["completion"], s.get("reward")) for s in rec.samples]
    checks = [e for e in read_jsonl(out / "health_events.jsonl") if e["event"] == "health_check"]
    for check in checks:
        assert check["findings"] == diagnose_records(truncate_records(rec, check["step"])).ids(), check["step"]
    garbled = [u for u in diagnose_records(rec).unchecked if u.id == "garbled_output"]
    assert not garbled  # checked, with the completions


def test_stop_ends_the_run_at_the_last_healthy_checkpoint(model_dir, tmp_path):
    out = tmp_path / "out"
    cb = HealthCallback(every=1, on={"alarm": "stop", "warning": "stop"})
    trainer = run(model_dir, out, cb, steps=12)
    stop = trainer.state.global_step
    assert stop < 12 and any(a == "stop" for _, a in cb.last_report.raised)
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert stop not in saved and (not saved or saved[-1] == stop - 1)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="HealthCallback on.alarm='halt'"):
        HealthCallback(on={"alarm": "halt"})
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        HealthCallback(every=0)
