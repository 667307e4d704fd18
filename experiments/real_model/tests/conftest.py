"""Test setup of the experiments (tests/conftest.py does not reach this directory): no network for Hugging Face."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
