"""The failure runs of the doctor's corpus: each fault acts from its fault step exactly (and not before), the
labels follow the corpus schema, harm_step follows its rule, and a labelled run is reused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from experiments.health_corpus import failures as fl
from meshrl.jsonl import read_jsonl

FAULT_AT = 3
STEPS = 4


def _run(tmp_path: Path, kind: str, recipe: str = "grpo") -> tuple[fl.RunSpec, Path]:
    """A 4-step run on the untrained tiny model (no warm start: the grading, not the learning, is tested)."""
    spec = fl.RunSpec(kind, seed=1, recipe=recipe, steps=STEPS, fault_at=FAULT_AT)
    path, seconds = fl.build_run(spec, tmp_path, "tiny")
    assert seconds is not None
    return spec, path


# ---------------------------------------------------------------------------------------------- faults act on time
def test_constant_reward_acts_from_the_fault_step(tmp_path):
    _, path = _run(tmp_path, "constant_reward")
    metrics = read_jsonl(path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    samples = read_jsonl(path / "samples.jsonl")
    before = [s["score"] for s in samples if s["step"] < FAULT_AT]
    after = [s["score"] for s in samples if s["step"] >= FAULT_AT]
    assert after and all(s == fl.CONSTANT for s in after)
    assert any(s != fl.CONSTANT for s in before)  # the untrained model earns 0 or a share of matching chars
    for m in metrics:
        flat = m["step"] >= FAULT_AT
        assert (m["reward/mean"] == fl.CONSTANT and m["reward/std"] == 0.0) is flat
        if flat:
            assert m["adv/abs_mean"] == 0.0
    # Before the fault a step's groups may all be uniform by chance (an untrained model); not all of them are.
    assert any(m["adv/abs_mean"] > 0.0 for m in metrics if m["step"] < FAULT_AT)


def test_broken_grouping_acts_from_the_fault_step(tmp_path):
    _, path = _run(tmp_path, "broken_grouping")
    for m in read_jsonl(path / "metrics.jsonl"):
        assert (m["group/size1_frac"] == 1.0) is (m["step"] >= FAULT_AT), m
    for s in read_jsonl(path / "samples.jsonl"):
        assert isinstance(s["group_id"], str) is (s["step"] >= FAULT_AT)


@pytest.mark.parametrize(("kind", "key", "before", "after"), [
    ("lr_blowup", "lr", fl.LR, fl.LR * 100),
])
def test_a_fault_made_at_a_resume_acts_from_the_fault_step(tmp_path, kind, key, before, after):
    _, path = _run(tmp_path, kind)
    values = {m["step"]: m[key] for m in read_jsonl(path / "metrics.jsonl")}
    assert values == {1: before, 2: before, 3: after, 4: after}
    # the held-out evaluation runs on both sides of the resume (the first segment's last step is evaluated too)
    assert [r["step"] for r in read_jsonl(path / "evals.jsonl")] == [FAULT_AT - 1, STEPS]


def test_truncation_cuts_every_answer_from_the_fault_step(tmp_path):
    _, path = _run(tmp_path, "truncation")
    lengths = {m["step"]: m["len/response_max"] for m in read_jsonl(path / "metrics.jsonl")}
    assert lengths[3] == lengths[4] == 1.0 and max(lengths[1], lengths[2]) > 1.0


def test_faulty_verifiers_grade_as_described():
    # broken_verifier: the answer key is shifted by one symbol
    assert fl.faulty_score("broken_verifier", "7", "7", 1.0) == 0.0
    assert fl.faulty_score("broken_verifier", "8", "7", 0.0) == 1.0
    assert fl.faulty_score("broken_verifier", "0", "f", 0.0) == 1.0  # wraps around
    # reward_hacking: the loophole pays 1, an honest right answer only HONEST_WEIGHT
    assert fl.faulty_score("reward_hacking", "3f", "3", 0.5) == 1.0
    assert fl.faulty_score("reward_hacking", "3", "3", 1.0) == fl.HONEST_WEIGHT
    assert fl.faulty_score("reward_hacking", "4", "3", 0.0) == 0.0


def test_apply_fault_changes_the_scores_the_records_read():
    problem = SimpleNamespace(answer="3")
    data = SimpleNamespace(texts=["3", "f"], problems=[problem, problem], scores=[1.0, 0.0], group_ids=[0, 0],
                           seen=[("3", 1.0, problem), ("f", 0.0, problem)], stats={})
    fl.apply_fault("reward_hacking", data)
    assert data.scores == [fl.HONEST_WEIGHT, 1.0]
    assert [s for _, s, _ in data.seen] == data.scores
    assert data.stats["reward/sampled_mean"] == pytest.approx((fl.HONEST_WEIGHT + 1.0) / 2)
    with pytest.raises(ValueError, match="lr_blowup"):
        fl.apply_fault("lr_blowup", data)  # not a plug-in fault


# ---------------------------------------------------------------------------------------------- labels
def test_label_follows_the_schema_and_a_labelled_run_is_reused(tmp_path):
    spec, path = _run(tmp_path, "reward_hacking")
    label = json.loads((path / "label.json").read_text())
    assert fl.check_label(label) == label
    assert label["id"] == "tiny/failure/reward_hacking/s1" and path == tmp_path / label["id"]
    assert (label["source"], label["kind"], label["engine"], label["outcome"]) == (
        "tiny/failure", "reward_hacking", "meshrl", "harmful")
    assert label["fault_step"] == FAULT_AT and label["steps"] == STEPS and label["split"] == "report"
    assert not (path / "checkpoints").exists() and (path / "config.yaml").is_file()
    mtime = (path / "metrics.jsonl").stat().st_mtime_ns
    assert fl.build_run(spec, tmp_path, "tiny") == (path, None)
    assert (path / "metrics.jsonl").stat().st_mtime_ns == mtime


def test_an_unfinished_run_is_trained_again(tmp_path):
    spec = fl.RunSpec("healthy", seed=0, recipe="dr_grpo", steps=2)
    path = tmp_path / spec.run_id
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a meshrl run"):
        fl.build_run(spec, tmp_path, "tiny")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')  # an unmarked run's records beside the user's file: the
    with pytest.raises(ValueError, match="not a meshrl run"):  # whole directory would go, so it is refused
        fl.build_run(spec, tmp_path, "tiny")
    (path / "metrics.jsonl").unlink()
    (path / "notes.txt").unlink()
    (path / "..meshrl-run.x1y2").write_text("")  # a kill while the marker was written: ours, trained again
    path, _ = fl.build_run(spec, tmp_path, "tiny")
    (path / "label.json").unlink()
    (path / ".meshrl-run").write_text("")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    path, seconds = fl.build_run(spec, tmp_path, "tiny")
    label = json.loads((path / "label.json").read_text())
    assert seconds is not None and label["steps"] == 2
    assert (label["kind"], label["outcome"], label["fault_step"], label["harm_step"], label["split"]) == (
        "healthy", "healthy", None, None, "tune")
    assert label["id"] == "tiny/healthy/dr_grpo/s0"


def _valid() -> dict:
    return {"id": "tiny/failure/lr_blowup/s0", "source": "tiny/failure", "engine": "meshrl", "outcome": "harmful",
            "kind": "lr_blowup", "fault_step": 13, "harm_step": None, "steps": 40, "split": "tune", "note": "x"}


@pytest.mark.parametrize(("change", "field"), [
    ({"kind": "lr_explosion"}, "kind"),
    ({"source": "tiny"}, "source"),
    ({"outcome": "bad"}, "outcome"),
    ({"split": "test"}, "split"),
    ({"engine": "verl"}, "engine"),
    ({"fault_step": 0}, "fault_step"),
    ({"harm_step": "16"}, "harm_step"),
    ({"steps": None}, "steps"),
    ({"steps": True}, "steps"),
    ({"note": "two\nlines"}, "note"),
    ({"kind": "healthy"}, "fault_step"),
    ({"extra": 1}, "extra"),
])
def test_check_label_names_the_bad_field(change, field):
    assert fl.check_label(_valid()) == _valid()
    with pytest.raises(ValueError, match=field):
        fl.check_label({**_valid(), **change}, "DIR/label.json")
    with pytest.raises(ValueError, match="missing.*'note'"):
        fl.check_label({k: v for k, v in _valid().items() if k != "note"})


# ---------------------------------------------------------------------------------------------- harm_step
@pytest.mark.parametrize(("evals", "fault", "expected"), [
    # a drop of >= 0.05 below the best, and below the eval before the fault
    ([(4, 0.4), (8, 0.5), (12, 0.55), (16, 0.06), (20, 0.06)], 13, 16),
    # a drop exactly 0.05 below the best counts
    ([(4, 0.5), (8, 0.6), (12, 0.6), (16, 0.55)], 13, 16),
    # below the best by >= 0.05 but not below the pre-fault eval: a dip after a post-fault rise is no harm yet
    ([(4, 0.4), (12, 0.5), (16, 0.7), (20, 0.6), (24, 0.45)], 13, 24),
    # drops before the fault do not count
    ([(4, 0.6), (8, 0.4), (12, 0.45), (16, 0.46)], 13, None),
    # never dropping: None
    ([(4, 0.4), (12, 0.5), (16, 0.52), (20, 0.6)], 13, None),
    # unsorted input is sorted
    ([(16, 0.1), (4, 0.4), (12, 0.5)], 13, 16),
    # a fault from step 1: no pre-fault eval, only the best-so-far condition
    ([(4, 0.5), (8, 0.46), (12, 0.44)], 1, 12),
    # no fault: no harm step
    ([(4, 0.5), (8, 0.1)], None, None),
])
def test_harm_step_rule(evals, fault, expected):
    assert fl.harm_step(evals, fault, 0.05) == expected


def test_bf16_sampler_acts_from_the_fault_step(tmp_path):
    _, path = _run(tmp_path, "bf16_mismatch")
    gap = {m["step"]: m["mismatch/logp_absdiff_mean"] for m in read_jsonl(path / "metrics.jsonl")}
    # fp32 sampler and fp32 update agree to ~1e-7; the bf16-autocast sampler does not (docs/doctor.md)
    assert max(gap[1], gap[2]) < 1e-5 < 1e-4 < min(gap[3], gap[4]), gap


def test_smollm2_runs_are_valid_configs_with_the_readme_data(tmp_path):
    import random

    from experiments.health_corpus import smollm
    from meshrl.trainer import load_config

    todo = smollm.smollm_specs(tmp_path)
    assert [s.run_id for s in todo] == ["smollm2/meshrl/healthy/s0", "smollm2/meshrl/healthy/s1",
                                        "smollm2/meshrl/lr_blowup/s0"]
    assert [s.fault_step for s in todo] == [None, None, smollm.FAULT_STEP]
    for spec in todo:
        before = load_config(overrides=spec.overrides("smollm2-135m"))  # validated; the model is not loaded
        assert before.model == "smollm2-135m" and before.steps == smollm.STEPS and before.eval.every > 0
        after = load_config(overrides=[*spec.overrides("smollm2-135m"), *(spec.resume_overrides() or [])])
        assert after.optim.lr == pytest.approx(smollm.LR * 100 if spec.kind == "lr_blowup" else smollm.LR)
    # the README's add.jsonl: the global random module seeded with 0
    random.seed(0)
    first = (random.randint(1, 20), random.randint(1, 20))
    row = json.loads((tmp_path / "_data" / "add.jsonl").read_text().splitlines()[0])
    assert row == {"problem": f"What is {first[0]} + {first[1]}?", "answer": sum(first)}
