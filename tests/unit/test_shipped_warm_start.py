"""The warm start shipped with the package is the demo's, made with exactly the settings the demo asks for, and
``warm_start`` hands it out instead of training (``meshrl demo`` then skips its longest phase); other settings
train: tests/integration/test_shipped_warm_start_train.py."""

from __future__ import annotations

import json

from meshrl.testbed.demo import DemoSettings
from meshrl.testbed.warm import MARKER, SHIPPED, settings_hash, warm_settings, warm_start


def _demo_settings() -> dict:
    return warm_settings(seed=0, steps=DemoSettings().warm_steps, preset="tiny:small", batch_size=64, lr=3e-3,
                         coach_fraction=0.06)


def test_the_shipped_warm_start_is_the_demos_current_one():
    shipped = sorted(SHIPPED.glob("warm_*"))
    settings = _demo_settings()
    assert [p.name for p in shipped] == [f"warm_{settings_hash(settings)}"], (
        "the shipped warm start does not match the demo's settings: run scripts/ship_warm_start.py")
    marker = json.loads((shipped[0] / MARKER).read_text())
    assert marker["settings"] == settings
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in shipped[0].iterdir()}


def test_warm_start_returns_the_shipped_copy_and_it_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path))  # an empty cache: only the shipped copy can answer
    path = warm_start(seed=0, steps=DemoSettings().warm_steps, progress=False)
    assert path.parent == SHIPPED and not any(tmp_path.iterdir())
    from meshrl.models import load_model

    model, tok = load_model(str(path))
    assert tok.decode(tok.encode("12+3", add_special_tokens=False)) == "12+3"
    assert sum(p.numel() for p in model.parameters()) > 0
