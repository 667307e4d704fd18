"""``warm_start`` with settings other than the shipped ones trains, and caches what it trained."""

from __future__ import annotations

from meshrl.testbed.warm import MARKER, warm_start


def test_other_settings_still_train_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path))
    path = warm_start(seed=0, steps=2, batch_size=4, progress=False)  # not shipped: trained, cached
    assert path.parent == tmp_path / "testbed" and (path / MARKER).is_file()
