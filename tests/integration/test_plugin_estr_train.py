"""``plugins.estr`` (entropy-scaled trust region) in the trainer: its kept behaviour entropies across a resume, and
runs on the tiny model (on-policy: plain GRPO exactly; with replay: the sampler's entropies, reused). The keep rule,
the policy term and the settings: tests/unit/test_plugin_estr.py."""

from __future__ import annotations

import json
import math

import pytest

from meshrl.testing import tiny_config
from meshrl.trainer import train


def test_on_policy_it_is_plain_grpo(tmp_path):
    plain = train(tiny_config("train.update_workers=1", "train.skip_zero_advantage=false"), tmp_path / "plain")
    estr = train(tiny_config("plugins.estr.enabled=true", "plugins.estr.tau=1e-6"), tmp_path / "estr")
    for a, b in zip(plain, estr, strict=True):
        assert b["estr/masked_frac"] == 0.0  # ratio 1: delta = 0 inside any region
        assert b["loss/policy"] == a["loss/policy"] and b["grad/norm"] == a["grad/norm"]


def test_replay_uses_the_samplers_entropies(tmp_path):
    hist = train(tiny_config("plugins.replay.reuse_steps=2", "plugins.estr.enabled=true", "plugins.estr.tau=0.05",
                             "optim.lr=1e-2", steps=3), tmp_path / "r")
    assert [m["replay/age"] for m in hist] == [0.0, 1.0, 2.0]
    assert hist[0]["estr/masked_frac"] == 0.0 and hist[0]["estr/score_mean"] == 0.0
    assert hist[2]["estr/score_mean"] > 0 and all(math.isfinite(m["grad/norm"]) for m in hist)
    # one batch, one behaviour policy: the same entropies at every reuse, while the policy's own entropy moves
    assert hist[0]["estr/entropy_mean"] == hist[1]["estr/entropy_mean"] == hist[2]["estr/entropy_mean"]
    assert hist[2]["entropy/mean"] != hist[0]["entropy/mean"]


def test_a_resume_mid_cycle_reproduces_the_uninterrupted_run(tmp_path):
    over = ["plugins.replay.reuse_steps=2", "plugins.estr.enabled=true", "plugins.estr.tau=0.05", "optim.lr=1e-2",
            "checkpoint.every=1", "checkpoint.keep_last=10", "train.update_workers=1"]
    full = train(tiny_config(*over, steps=4), tmp_path / "full")
    part = tmp_path / "part"
    train(tiny_config(*over, steps=2), part)
    state = json.loads((part / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["plugins"]["estr"]["entropy"]  # the sampler's entropies of the batch being reused
    resumed = train(tiny_config(*over, steps=4), part, resume=True)
    drop = ("time/", "throughput/")
    assert ([{k: v for k, v in m.items() if not k.startswith(drop)} for m in resumed]
            == [{k: v for k, v in m.items() if not k.startswith(drop)} for m in full[2:]])
    assert "estr/entropy_recomputed" not in resumed[0]


def test_a_checkpoint_without_its_entropies_warns_and_counts(tmp_path, caplog):
    over = ["plugins.replay.reuse_steps=2", "plugins.estr.enabled=true", "plugins.estr.tau=0.05",
            "checkpoint.every=1", "train.update_workers=1"]
    run = tmp_path / "r"
    train(tiny_config(*over, steps=1), run)
    path = run / "checkpoints" / "step_000001" / "state.json"
    state = json.loads(path.read_text())
    del state["plugins"]["estr"]  # written before the entropies were kept
    path.write_text(json.dumps(state))
    with caplog.at_level("WARNING", logger="meshrl"):
        hist = train(tiny_config(*over, steps=2), run, resume=True)
    assert "no state of plugins.estr" in caplog.text and "estr/entropy_recomputed" in caplog.text
    assert hist[-1]["replay/age"] == 1.0 and hist[-1]["estr/entropy_recomputed"] == 1.0


@pytest.mark.parametrize("extra", [
    ["recipe=dapo", "algo.dynamic_sampling=false"],
    ["recipe=mesh", "rollout.prompts_per_step=2", "mesh.m=2", "mesh.mu=0.1", "plugins.m2po.enabled=true"],
])
def test_it_composes_with_other_recipes_and_plugins(tmp_path, extra):
    hist = train(tiny_config(*extra, "plugins.replay.reuse_steps=1", "plugins.estr.enabled=true",
                             "plugins.estr.tau=0.5"), tmp_path / "c")
    assert [m["replay/age"] for m in hist] == [0.0, 1.0]
    assert all(math.isfinite(m["estr/masked_frac"]) and math.isfinite(m["grad/norm"]) for m in hist)
