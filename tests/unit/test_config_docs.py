"""The config is declared once: every key has help, the checks and the docs come from the declarations."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshrl.settings import iter_settings
from meshrl.trainer.config import RunConfig, load_config
from meshrl.trainer.config_reference import config_reference

ROOT = Path(__file__).resolve().parents[2]


def test_every_key_has_help():
    missing = [d.key for d in iter_settings(RunConfig) if not d.help]
    assert not missing, f"config keys without help: {missing}"


def test_docs_config_md_is_generated_from_the_declarations():
    assert (ROOT / "docs" / "config.md").read_text() == config_reference(markdown=True), (
        "docs/config.md is stale: run python scripts/gen_config_docs.py")


def _bounded_fields():
    """``(dotted key, value just outside its declared bound)`` of every numeric bound in RunConfig."""
    out = []

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{key}.")
                continue
            m = f.metadata
            if m.get("ge") is not None:
                out.append((key, m["ge"] - 1 if isinstance(m["ge"], int) else m["ge"] - 0.5))
            elif m.get("gt") is not None:
                out.append((key, m["gt"]))
            if m.get("le") is not None:
                out.append((key, m["le"] + 1))
            elif m.get("lt") is not None:
                out.append((key, m["lt"]))
            if m.get("choices") and not key.startswith("log."):
                out.append((key, "no-such-choice"))

    walk(RunConfig, "")
    return out


@pytest.mark.parametrize(("key", "value"), _bounded_fields())
def test_every_declared_bound_is_checked_and_named(key, value):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[f"{key}={value}"])


def test_algo_is_a_typed_section_seeded_by_the_recipe():
    cfg = load_config(overrides=["recipe=dapo", "algo.clip_high=0.3"])
    rec = cfg.resolved_recipe()
    assert rec.clip_high == pytest.approx(0.3) and rec.dynamic_sampling and rec.clip_low == pytest.approx(0.2)
    assert cfg.algo.clip_low is None and cfg.to_dict()["algo"] == {"clip_high": 0.3}  # only what was set
    with pytest.raises(ValueError, match=r"algo\.policy_loss='ppo'; known: ppo_clip"):
        load_config(overrides=["algo.policy_loss=ppo"])
    with pytest.raises(ValueError, match=r"algo\.kl_coef must be"):
        load_config(overrides=["algo.kl_coef=much"])
