"""`import verl` discovers meshrl's plugin through its entry point; the trainer mode reads verl's real config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")

from meshrl.algos import POLICY_LOSSES  # noqa: E402
from meshrl.integrations.verl.losses import PREFIX  # noqa: E402

PROBE = """
import json, sys
import verl
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
print(json.dumps({"losses": sorted(k for k in POLICY_LOSS_REGISTRY if k.startswith("meshrl_")),
                  "trainers": sorted(TRAINER_REGISTRY),
                  "plugin_loaded": "meshrl.integrations.verl.plugin" in sys.modules}))
"""


def _probe(**env: str) -> dict:
    """Run ``PROBE`` in a fresh interpreter: only verl's own import machinery can load the plugin there."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_verl_discovers_the_plugin():
    got = _probe()
    assert got["plugin_loaded"]
    assert got["losses"] == sorted(PREFIX + name for name in POLICY_LOSSES)
    assert "meshrl" in got["trainers"] and "sync" in got["trainers"]


def test_check_registered_names_what_is_missing(monkeypatch):
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.v1 import trainer_base

    from meshrl.integrations.verl import plugin

    plugin.check_registered()  # this process imported verl, so the plugin registered everything
    without_trainer = {k: v for k, v in trainer_base.TRAINER_REGISTRY.items() if k != "meshrl"}
    monkeypatch.setattr(trainer_base, "TRAINER_REGISTRY", without_trainer)
    monkeypatch.setitem(plugin.FAILED, "trainer", "ModuleNotFoundError: No module named 'transfer_queue'")
    with pytest.raises(RuntimeError, match="trainer mode 'meshrl' is not registered: .*transfer_queue"):
        plugin.check_registered()
    plugin.check_registered(trainer=False)
    without_losses = {k: v for k, v in core_algos.POLICY_LOSS_REGISTRY.items() if not k.startswith(PREFIX)}
    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", without_losses)
    with pytest.raises(RuntimeError, match="meshrl's policy losses are not registered in verl"):
        plugin.check_registered(trainer=False)
    monkeypatch.setitem(plugin.FAILED, "verl", "verl 0.8.0 is not supported")
    with pytest.raises(RuntimeError, match="verl 0.8.0 is not supported"):
        plugin.check_registered(trainer=False)


def _verl_config(*overrides: str):
    import verl
    from hydra import compose, initialize_config_dir

    base = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=4",
            "trainer.v1.trainer_mode=meshrl"]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=base + list(overrides))


def test_trainer_mode_reads_the_meshrl_block_of_verls_config():
    from meshrl.integrations.verl.loss_fn import mesh_loss
    from meshrl.integrations.verl.trainer import mesh_loss_for, mesh_settings_of

    cfg = _verl_config("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0",
                       "data.shuffle=false", "+meshrl.mu=5e-5", "+meshrl.reduction=sum", "+meshrl.js_coef=0.001")
    mesh = mesh_settings_of(cfg)
    assert (mesh.mu, mesh.reduction, mesh.js_coef, mesh.subtract_ref) == (5e-5, "sum", 0.001, True)
    fn = mesh_loss_for(cfg, mesh)
    assert fn.func is mesh_loss and fn.keywords["config"].loss_agg_mode == cfg.actor_rollout_ref.actor.loss_agg_mode
    with pytest.raises(ValueError, match="needs verl's reference log-probs: set actor_rollout_ref.actor.use_kl_loss"):
        mesh_settings_of(_verl_config("data.shuffle=false", "+meshrl.mu=5e-5"))
    with pytest.raises(ValueError, match="meshrl.mu > 0 needs data.shuffle=false"):
        mesh_settings_of(_verl_config("actor_rollout_ref.actor.use_kl_loss=true", "+meshrl.mu=5e-5"))
    with pytest.raises(ValueError, match=r"unknown meshrl setting\(s\) \['mu_typo'\]"):
        mesh_settings_of(_verl_config("+meshrl.mu_typo=1"))
    no_ref = mesh_settings_of(_verl_config("data.shuffle=false", "+meshrl.subtract_ref=false"))
    assert not no_ref.needs_reference
    assert mesh_settings_of(_verl_config("+meshrl.mu=0", "+meshrl.subtract_ref=false",
                                         "+meshrl.mei_sketch=64")).mei_sketch == 64
    with pytest.raises(ValueError, match="mei_sketch needs the engine's logits"):
        mesh_settings_of(_verl_config("data.shuffle=false", "+meshrl.subtract_ref=false", "+meshrl.mei_sketch=64",
                                      "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"))
