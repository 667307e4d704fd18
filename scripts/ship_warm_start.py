"""Rebuild the warm start shipped with the package (``meshrl.testbed.warm.SHIPPED``): the one ``meshrl demo``
starts from. Run it after a change to the warm start's settings, data or training loop (WARM_VERSION), then commit
the new directory and delete the old one (tests/unit/test_shipped_warm_start.py fails until they match).

    python scripts/ship_warm_start.py        # about 3-8 minutes on 2 cores
"""

from __future__ import annotations

import shutil

from meshrl.testbed.demo import DemoSettings
from meshrl.testbed.warm import SHIPPED, settings_hash, warm_settings, warm_start


def main() -> None:
    s = DemoSettings()
    settings = warm_settings(seed=0, steps=s.warm_steps, preset="tiny:small", batch_size=64, lr=3e-3,
                             coach_fraction=0.06)
    target = SHIPPED / f"warm_{settings_hash(settings)}"
    for old in SHIPPED.glob("warm_*"):
        if old != target:
            shutil.rmtree(old)
            print(f"removed {old}")
    print(warm_start(target, seed=0, steps=s.warm_steps, force=True))


if __name__ == "__main__":
    main()
