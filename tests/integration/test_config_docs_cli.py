"""The config's help as the CLI prints it, in a fresh interpreter: ``meshrl train --help-config`` names every key."""

from __future__ import annotations

import subprocess
import sys

from meshrl.settings import iter_settings
from meshrl.trainer.config import RunConfig


def test_help_config_prints_every_key():
    out = subprocess.run([sys.executable, "-c", "from meshrl.cli import main; main()", "train", "--help-config"],
                         capture_output=True,
                         text=True, check=True).stdout
    for d in iter_settings(RunConfig):
        assert (f"[{d.key}]" if d.is_section else f"  {d.key}: ") in out, d.key
