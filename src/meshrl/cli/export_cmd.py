"""``meshrl export TARGET``: a run's policy, or a task's data, in a format another tool loads.

The exporters, their shared options and the command itself are the export face, :mod:`meshrl.export`.
"""

from __future__ import annotations

from meshrl.export import add_parser

__all__ = ["add_parser"]
