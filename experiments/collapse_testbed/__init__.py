"""The collapse-testbed experiments: runner, arms and presets (YAML), tables, packs and figures.

Not part of the installed ``meshrl`` package: run from the repository root as
``python -m experiments.collapse_testbed`` (README.md in this directory).
"""
