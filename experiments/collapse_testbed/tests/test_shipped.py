"""The shipped warm starts (shipped.py, warm_starts/): the manifest matches the files, the runner refuses a changed
file, and the recorded settings are the presets'."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from experiments.collapse_testbed import shipped
from experiments.collapse_testbed.experiment import ExperimentSettings, check_resumable, preset_settings
from experiments.collapse_testbed.shipped import WARM_STARTS, read_manifest, sha256_file, verify

MANIFEST = read_manifest()


def test_every_warm_start_is_shipped_and_its_files_match_the_manifest():
    assert set(MANIFEST) == set(WARM_STARTS)
    for name, entry in MANIFEST.items():
        d = verify(name)
        assert {p.name for p in d.iterdir()} == set(entry["files"])
        assert "model.safetensors" in entry["files"] and "warm_start.json" in entry["files"]
        assert entry["bytes"] == sum((d / f).stat().st_size for f in entry["files"])
        assert entry["bytes"] < 8 << 20  # a few MB: weights and tokenizer, no optimiser state


@pytest.mark.parametrize(("name", "preset", "changes"), [("W1", "round1", {}), ("W2", "round2", {}),
                                                         ("W3", "round2", {"warm_seed": 1})])
def test_recorded_settings_are_the_presets(name, preset, changes):
    s = preset_settings(preset, **changes)
    expected = {"warm_seed": s.warm_seed, "warm_steps": s.warm_steps, "warm_coach_variants": s.warm_coach_variants,
                "task": s.task}
    entry = MANIFEST[name]
    assert entry["experiment_settings"] == expected == WARM_STARTS[name].experiment_fields()
    assert entry["settings"] == WARM_STARTS[name].settings()
    written = json.loads((shipped.WARM_DIR / name / "warm_start.json").read_text())["settings"]
    assert written == entry["settings"]


def test_w1_is_the_package_warm_start_byte_for_byte():
    from meshrl.testbed.warm import SHIPPED, settings_hash

    package = SHIPPED / f"warm_{settings_hash(WARM_STARTS['W1'].settings())}"
    assert {f: sha256_file(package / f) for f in MANIFEST["W1"]["files"]} == MANIFEST["W1"]["files"]


def test_the_warm_starts_differ():
    digests = [MANIFEST[n]["files"]["model.safetensors"] for n in WARM_STARTS]
    assert len(set(digests)) == len(digests)


def _copy_w1(root):
    shutil.copytree(shipped.WARM_DIR / "W1", root / "W1")
    shutil.copy(shipped.WARM_DIR / "MANIFEST.json", root / "MANIFEST.json")


def test_the_runner_refuses_a_changed_file(tmp_path, monkeypatch, capsys):
    from experiments.collapse_testbed.cli import main

    root = tmp_path / "warm"
    _copy_w1(root)
    weights = root / "W1" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    monkeypatch.setattr(shipped, "WARM_DIR", root)
    with pytest.raises(ValueError, match="model.safetensors does not match its SHA-256"):
        verify("W1")
    code = main(["--preset", "persistence", "--warm", "W1", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and str(weights) in err
    assert not (tmp_path / "out" / "runs").exists()  # refused before any run


def test_a_missing_or_extra_file_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "warm"
    _copy_w1(root)
    monkeypatch.setattr(shipped, "WARM_DIR", root)
    (root / "W1" / "optimizer.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="optimizer.pt is not in the manifest"):
        verify("W1")
    (root / "W1" / "optimizer.pt").unlink()
    (root / "W1" / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        verify("W1")


def test_warm_replaces_the_presets_warm_settings_and_the_default_is_unchanged():
    s = preset_settings("round1", warm="W3")
    assert (s.warm, s.warm_seed, s.warm_coach_variants) == ("W3", 1, True)
    assert preset_settings("round2").warm == "" == ExperimentSettings().warm
    assert not ExperimentSettings().ckpt_eval_warm
    with pytest.raises(ValueError, match="cannot run --task testbed:audit"):
        preset_settings("round2", warm="W2", task="testbed:audit")


def test_persistence_preset():
    s = preset_settings("persistence")
    assert (s.arms, s.seeds, s.steps, s.ckpt_eval_every, s.probe_arms) == (("grpo", "cp_only"), tuple(range(6)),
                                                                         160, 8, ("grpo", "cp_only"))
    assert (s.probe_every, s.probe_group, s.probe_features) == (4, 16, ("bias", "head"))  # the paper's MEI: G = 16
    assert s.warm == "W2" and s.ckpt_eval_warm and "health.every=4" in s.extra
    assert preset_settings("persistence", warm="W1").warm_coach_variants is False


def test_resuming_with_another_warm_start_is_refused(tmp_path):
    # a directory from before shipped warm starts (no "warm" key) was built from the warm_* settings
    old = json.loads(json.dumps(ExperimentSettings().__dict__, default=list))
    old.pop("warm")
    (tmp_path / "settings.json").write_text(json.dumps(old))
    check_resumable(tmp_path, ExperimentSettings())
    with pytest.raises(ValueError, match="warm=''"):
        check_resumable(tmp_path, preset_settings("round2", warm="W2"))


@pytest.mark.slow
def test_a_toy_run_starts_from_the_shipped_weights_with_a_step_0_evaluation(tmp_path):
    from experiments.collapse_testbed import persistence
    from experiments.collapse_testbed.cli import main
    from experiments.collapse_testbed.experiment import run_experiment
    from experiments.collapse_testbed.pack import pack_experiment

    s = ExperimentSettings(steps=2, prompts_per_step=2, group_size=3, eval_problems=4, eval_n=2, ks=(1, 2),
                           seeds=(0,), arms=("grpo", "cp_only"), probe_arms=(), ckpt_eval_every=1,
                           ckpt_eval_problems=4, warm="W1", warm_coach_variants=False, ckpt_eval_warm=True,
                           workers=2)
    out = run_experiment(tmp_path / "exp", s, progress=False)
    settings = json.loads((out / "settings.json").read_text())
    assert settings["warm"] == "W1" and settings["warm_start"] == str(shipped.WARM_DIR / "W1")
    cfg = (out / "runs" / "grpo" / "seed_0" / "config.yaml").read_text()
    assert str(shipped.WARM_DIR / "W1") in cfg
    runs = persistence.read_runs("W1", out, horizon=2)
    assert [(r.arm, r.steps) for r in runs] == [("cp_only", [0, 1, 2]), ("grpo", [0, 1, 2])]
    assert runs[0].niche[0] == runs[1].niche[0]  # one warm start, one step-0 evaluation per seed
    pack_experiment(out, tmp_path / "pack.json.gz")
    with gzip.open(tmp_path / "pack.json.gz", "rt") as fh:
        assert "warm_eval/seed_0/eval.json" in json.load(fh)
    (out / "runs" / "grpo" / "seed_0" / "done.json").unlink()  # as if still running: a partial pack leaves it out
    assert main(["--out", str(out), "--pack-finished", str(tmp_path / "part.json.gz")]) == 0
    with gzip.open(tmp_path / "part.json.gz", "rt") as fh:
        names = json.load(fh)
    assert "runs/cp_only/seed_0/done.json" in names and not any(n.startswith("runs/grpo/") for n in names)
