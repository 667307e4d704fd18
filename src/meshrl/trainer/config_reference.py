"""The configuration reference (``meshrl train --help-config`` and ``docs/config.md``), written from the settings'
declarations in :mod:`meshrl.trainer.config` and the plug-ins' files."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from meshrl.settings import iter_settings
from meshrl.trainer.config import ALGO_CHOICES, RunConfig


def config_reference(markdown: bool = False) -> str:
    """Every config key with its type, default, bounds and help, from the declarations (``meshrl train
    --help-config``; with ``markdown``, the text of ``docs/config.md``)."""
    docs = [_with_registry(d) for d in iter_settings(RunConfig)]
    if not markdown:
        lines = []
        for d in docs:
            if d.is_section:
                lines.append(f"\n[{d.key}]  {d.help}")
            else:
                bounds = f"  ({d.bounds})" if d.bounds else ""
                lines.append(f"  {d.key}: {d.type} = {_shown(d.default)}{bounds}\n      {d.help}")
        return "\n".join(lines).lstrip("\n") + "\n"
    out = ["# Configuration reference", "",
           "Every key of `meshrl train` (`--config FILE.yaml`, `--set key=value`), generated from the declarations in",
           "`src/meshrl/trainer/config.py` and the plug-ins' files (`python scripts/gen_config_docs.py`; a test keeps",
           "this page equal to them). `null` in a default means unset; bounds are checked when the config loads, and",
           "an error names the key.", "", "## Top-level keys", "", *_TABLE_HEAD]
    out += [_row(d) for d in docs if "." not in d.key and not d.is_section]
    for d in docs:
        if d.is_section:
            out += ["", f"{'#' * min(d.key.count('.') + 2, 4)} `{d.key}`", "", d.help[:1].upper() + d.help[1:] + ".",
                    "", *_TABLE_HEAD]
        elif "." in d.key:
            out.append(_row(d))
    return "\n".join(out) + "\n"


_TABLE_HEAD = ("| key | type | default | allowed | what it does |", "|---|---|---|---|---|")


def _row(d: Any) -> str:
    cells = [f"`{d.key}`", d.type.replace(" | ", " or ").replace("None", "null"), f"`{_shown(d.default)}`", d.bounds,
             d.help]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _with_registry(d: Any) -> Any:
    """``algo`` keys whose values are registry names: the names registered now, as their bounds."""
    name = d.key.removeprefix("algo.")
    if d.key.startswith("algo.") and name in ALGO_CHOICES:
        return dataclasses.replace(d, bounds="one of " + ", ".join(ALGO_CHOICES[name]))
    return d


def _shown(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if isinstance(value, list | dict) else str(value)
