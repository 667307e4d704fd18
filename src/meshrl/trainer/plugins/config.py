"""The ``plugins:`` config section, built from the registry, and its checks.

``plugins.<name>`` is each registered plug-in's ``Config``; ``plugins.custom`` lists plug-ins from the user's own
modules, ``[{path: "mypkg.mod:MyPlugin", <its Config keys>...}]``, imported when the config is checked.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from meshrl.settings import check_settings, section, setting
from meshrl.trainer.plugins.base import REGISTRY, SAMPLING_HOOKS, Plugin

SEQUENCE_LEVEL_LOSSES = ("gspo",)  # one ratio and one advantage per sequence: no per-token selection


def _enabled(self: Any) -> list[str]:
    """Names of the built-in plug-ins this config turns on."""
    return [name for name, cls in REGISTRY.items() if cls.is_enabled(getattr(self, name))]


PluginsConfig = dataclasses.make_dataclass(
    "PluginsConfig",
    [(name, cls.Config, section(cls.Config, cls.summary or name)) for name, cls in REGISTRY.items()]
    + [("custom", Any, setting(factory=list, help="plug-ins from your own modules: a list of {path: "
                                                  "'pkg.module:Class', <the class's Config keys>}"))],
    namespace={"enabled": _enabled, "__module__": __name__},
)
PluginsConfig.__doc__ = "One section per registered plug-in (docs/plugins.md), and ``custom``."


def load_custom(entry: Any, where: str) -> tuple[type[Plugin], Any]:
    """``(class, config)`` of one ``plugins.custom`` entry; ``ValueError`` naming ``where`` on anything wrong."""
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or ":" not in entry["path"]:
        raise ValueError(f"{where} must be a mapping with path: 'package.module:Class', got {entry!r}")
    module_name, _, attr = entry["path"].partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}.path {entry['path']!r}: cannot import it ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, Plugin)) or not dataclasses.is_dataclass(cls.Config):
        raise ValueError(f"{where}.path {entry['path']!r} is not a meshrl Plugin subclass with a Config dataclass")
    options = {k: v for k, v in entry.items() if k != "path"}
    known = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) {[f'{where}.{k}' for k in unknown]}; known: {sorted(known)}")
    return cls, cls.Config(**options)


def _instances(plugins: Any) -> list[tuple[str, type[Plugin], Any]]:
    """``(config key, class, config)`` of every built-in and custom plug-in, enabled or not."""
    out = [(f"plugins.{name}", cls, getattr(plugins, name)) for name, cls in REGISTRY.items()]
    if not isinstance(plugins.custom, list):
        raise ValueError(f"plugins.custom must be a list of mappings, got {plugins.custom!r}")
    seen: dict[str, int] = {}
    for i, entry in enumerate(plugins.custom):
        where = f"plugins.custom[{i}]"
        cls, cfg = load_custom(entry, where)
        if entry["path"] in seen:
            first = seen[entry["path"]]
            raise ValueError(f"{where}.path {entry['path']!r} is listed twice (also plugins.custom[{first}]); "
                             "a plug-in is known by its path (its checkpoint state too): list it once")
        seen[entry["path"]] = i
        out.append((where, cls, cfg))
    return out


def validate_plugins(plugins: Any, policy_loss_name: str, run_cfg: Any = None) -> None:
    """Raise ``ValueError`` naming the ``plugins.*`` key of an invalid or incompatible setting."""
    found = _instances(plugins)
    bad = [(f"{key}.{k}", v) for key, _, cfg in found for k, v, _ in check_settings(cfg)]
    if bad:
        values = ", ".join(f"{k}={v!r}" for k, v in bad)
        raise ValueError(f"invalid plug-in setting(s): {values} (see docs/plugins.md)")
    for _, cls, cfg in found:  # also when off: a setting that is wrong stays wrong when the plug-in is turned on
        cls.check(cfg, run_cfg)
    on = [(key, cls, cfg) for key, cls, cfg in found if cls.is_enabled(cfg)]
    names = {cls.name for _, cls, _ in on}
    for key, cls, _ in on:
        for other in cls.excludes:
            if other in names:
                raise ValueError(f"{key}.enabled and plugins.{other}.enabled exclude each other")
    token_level = [key for key, cls, _ in on if cls.token_level]
    if token_level and policy_loss_name in SEQUENCE_LEVEL_LOSSES:
        raise ValueError(f"{token_level[0]}.enabled needs a token-level policy loss; the recipe's "
                         f"policy_loss is {policy_loss_name!r} (one ratio per sequence): use gspo_token, ppo_clip "
                         "or cispo")


def check_lagged(plugins: Any, k: int) -> None:
    """Raise ``ValueError`` naming the enabled plug-in that cannot run on batches sampled ``k >= 1`` steps ahead by
    another process (``rollout.max_staleness``): one whose sampling hooks read or change batches in the trainer
    (unless ``lag_safe``), or one with a ``lag_refusal``."""
    for key, cls, cfg in _instances(plugins):
        if not cls.is_enabled(cfg):
            continue
        key = f"{key}.enabled" if hasattr(cfg, "enabled") else key  # e.g. replay is on by its reuse_steps
        hooks = [h for h in SAMPLING_HOOKS if getattr(cls, h) is not getattr(Plugin, h)]
        if hooks and not cls.lag_safe:
            raise ValueError(f"{key} cannot run with rollout.max_staleness={k}: its sampling hooks "
                             f"({', '.join(hooks)}) read or change batches in the trainer's process, where a lagged "
                             "batch is neither sampled nor from the current policy; set rollout.max_staleness=0")
        if cls.lag_refusal:
            raise ValueError(f"{key} cannot run with rollout.max_staleness={k}: {cls.lag_refusal}")


def enable_staleness_correction(plugins: Any, how: str) -> str | None:
    """Turn on the built-in plug-in whose ``corrects_staleness`` is ``how`` (``plugins`` changed in place); its
    config key, or None when it was on already."""
    for key, cls, cfg in _instances(plugins):
        if cls.corrects_staleness == how and hasattr(cfg, "enabled"):
            if cfg.enabled:
                return None
            cfg.enabled = True
            return key
    raise ValueError(f"rollout.staleness_correction={how!r}: no plug-in implements it")


def plugins_need_reference(plugins: Any) -> bool:
    """Whether an enabled plug-in scores rollouts under the frozen reference (the trainer then keeps one)."""
    return any(cls.is_enabled(cfg) and cls.uses_reference(cfg) for _, cls, cfg in _instances(plugins))
