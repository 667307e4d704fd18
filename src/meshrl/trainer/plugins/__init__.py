"""Plug-ins around the recipes' policy term, one registered class per file of this package (docs/plugins.md).

Every module here is imported when the package is, and each registers its class (:func:`base.register`); the
``plugins:`` config section is built from the registry (one sub-section per plug-in, plus ``custom`` for
plug-ins in the user's own modules), and the trainer runs the enabled ones through :class:`TrainPlugins`. A new
technique is one file here (or in the user's package) and its test: nothing else names it.
"""

from __future__ import annotations

import importlib
import pkgutil

from meshrl.trainer.plugins.base import (
    CONFIG_HOOKS,
    REGISTRY,
    SAMPLING_HOOKS,
    STATE_HOOKS,
    UPDATE_HOOKS,
    Plugin,
    PluginContext,
    Stage,
    TokenTerms,
    register,
)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in ("base", "host", "config"):
        importlib.import_module(f"{__name__}.{_module}")

from meshrl.trainer.plugins.config import (  # noqa: E402
    PluginsConfig,
    check_lagged,
    enable_staleness_correction,
    load_custom,
    plugins_need_reference,
    validate_plugins,
)
from meshrl.trainer.plugins.host import TrainPlugins  # noqa: E402

__all__ = ["CONFIG_HOOKS", "REGISTRY", "SAMPLING_HOOKS", "STATE_HOOKS", "UPDATE_HOOKS", "Plugin", "PluginContext",
           "PluginsConfig", "Stage", "TokenTerms", "TrainPlugins", "check_lagged", "enable_staleness_correction",
           "load_custom", "plugins_need_reference", "register", "validate_plugins"]
