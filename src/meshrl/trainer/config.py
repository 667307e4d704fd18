"""Training configuration: nested dataclasses, YAML files and ``--set key=value`` overrides.

Unknown keys are errors that name the key (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from meshrl.algos import RECIPES, Recipe, recipe
from meshrl.trainer.plugins import PluginsConfig, validate_plugins
from meshrl.trainer.schedule import SCHEDULES


@dataclass
class RolloutConfig:
    backend: str = "auto"  # auto: native when the model is Llama-family, else hf; or hf | native | vllm
    prompts_per_step: int = 8  # distinct problems per step
    group_size: int = 8  # G samples per problem
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 64  # prompts per generate call (memory bound)
    decode_workers: int = 0  # native backend on CPU: decoders in parallel (0 = one per torch thread)
    autocast_bf16: bool = False  # hf/native: sample under bf16 autocast (the update: train.autocast_bf16)


@dataclass
class OptimConfig:
    lr: float = 1e-5
    warmup_steps: int = 0  # linear warm-up over training steps
    schedule: str = "constant"  # after warm-up: constant | linear | cosine (meshrl.trainer.schedule)
    min_lr_ratio: float = 0.0  # linear / cosine end at lr * min_lr_ratio at the last step
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


@dataclass
class TrainConfig:
    ppo_epochs: int = 1  # passes over each step's rollouts
    mini_batches: int = 1  # optimiser steps per epoch
    micro_batch_size: int = 16  # sequences per forward/backward (gradient accumulation)
    dtype: str = "float32"  # model weights
    autocast_bf16: bool = False  # bf16 autocast for forward passes on CPU/GPU
    share_prompts: bool = True  # run each distinct prompt once per micro-batch and reuse its KV cache
    pack_responses: bool = True  # Llama-family: responses of one prompt packed into rows (block-diagonal mask)
    length_buckets: int = 2  # otherwise: response-length groups per micro-batch, each padded to its longest
    update_workers: int = 0  # CPU: processes sharing each micro-batch (0 = one per thread up to 16M trainable)
    skip_zero_advantage: bool = True  # rows with advantage 0 run forward only when their gradient is exactly 0
    lora_r: int = 0  # > 0 enables LoRA (peft) with this rank
    lora_alpha: int = 16


@dataclass
class RewardConfig:
    timeout_s: float = 5.0
    strict: bool = False  # an error or timeout in a reward function aborts the run


@dataclass
class DynamicSamplingConfig:
    max_rounds: int = 4  # generation rounds per step to refill the batch (DAPO)


@dataclass
class EvalDuringTrainConfig:
    every: int = 0  # evaluate on the held-out split every E steps (0 = off); also at the last step
    split: str = "eval"
    n: int = 4  # samples per problem
    limit: int = 64  # held-out problems (0 = all)
    temperature: float = 1.0
    max_new_tokens: int = 0  # 0 = rollout.max_new_tokens


@dataclass
class CheckpointConfig:
    every: int = 10
    keep_last: int = 2


@dataclass
class LogConfig:
    samples_per_step: int = 4  # rollouts written to samples.jsonl per step
    report_to: list[str] = field(default_factory=list)  # tensorboard, wandb, trackio
    progress: bool = True


@dataclass
class FailureConfig:
    max_nonfinite: int = 3  # abort after this many consecutive non-finite steps
    max_stalled: int = 3  # stop after this many steps in a row with zero gradient, non-zero advantages


MESH_RECIPES = ("mesh", "cp_only")
ROLLOUT_BACKENDS = ("auto", "hf", "native", "vllm")
LR_SCHEDULES = SCHEDULES
DTYPES = ("float32", "bfloat16")
TRACKERS = ("tensorboard", "wandb", "trackio")
# What each range check of RunConfig.validate allows, said in the error.
RANGES = {
    "steps": ">= 0", "rollout.group_size": ">= 1", "rollout.prompts_per_step": ">= 1",
    "rollout.max_new_tokens": ">= 1", "rollout.temperature": ">= 0", "rollout.top_p": "in (0, 1]",
    "rollout.batch_size": ">= 1", "rollout.decode_workers": ">= 0", "optim.lr": "> 0",
    "optim.warmup_steps": ">= 0", "optim.min_lr_ratio": "in [0, 1]", "optim.weight_decay": ">= 0",
    "optim.max_grad_norm": "> 0", "optim.beta1": "in [0, 1)", "optim.beta2": "in [0, 1)", "optim.eps": "> 0",
    "train.ppo_epochs": ">= 1", "train.mini_batches": ">= 1", "train.micro_batch_size": ">= 1",
    "train.length_buckets": ">= 1", "train.update_workers": ">= 0", "train.lora_r": ">= 0",
    "train.lora_alpha": "> 0", "reward.timeout_s": "> 0", "dynamic_sampling.max_rounds": ">= 1",
    "eval.every": ">= 0", "eval.n": ">= 1", "eval.limit": ">= 0", "eval.temperature": ">= 0",
    "eval.max_new_tokens": ">= 0", "checkpoint.every": ">= 1", "checkpoint.keep_last": ">= 1",
    "log.samples_per_step": ">= -1 (-1 = all)", "failure.max_nonfinite": ">= 1",
    "failure.max_stalled": ">= 0 (0 = off)", "diag.mei.every": ">= 0",
    "diag.mei.patience": ">= 1",
}


@dataclass
class MeshConfig:
    """Coach Prompting + Strategy-Balancing (recipes ``mesh`` and ``cp_only``; docs/method.md §1.3)."""

    base: str = "grpo"  # the GRPO-family recipe underneath (the paper's Mesh is GRPO-based)
    prefixes: str | None = None  # prefixes.jsonl from `meshrl coach`; None = the task's rule strategies
    m: int = 4  # strategies (prefix groups) per query
    placement: str = "system"  # "system" (as the paper's release) or "assistant" (masked prefix tokens)
    template: str = "wrapped"  # "wrapped": the anti-hacking template; "plain": the prefix text alone
    budget: str = "matched"  # "matched": m groups of G/m; "per_prefix": m groups of G
    adv_unit: str = "prefix_group"  # advantage normalisation unit: "prefix_group" (release) or "query"
    mu: float = 1e-5  # balancing strength (cp_only forces 0)
    balance: str = "paper"  # "paper": KL(uniform||softmax(z - z_ref)) on conditioned logps; "support":
    # meshrl's extension, one-sided on the unconditioned logps (meshrl.mesh.support)
    bare_group: bool = False  # meshrl extension: one more group per query sampled WITHOUT a prefix, so the
    # policy that runs at test time is trained too; matched budget: m + 1 groups of G/(m + 1)
    bare_groups: int = 1  # prefix-free groups when bare_group is on (testbed round two: m = half the budget)
    subtract_ref: bool = True  # r = z - z_ref (paper); False = the release variant without the reference
    reduction: str = "mean"  # over queries: "mean" (all queries), "mean_active", "sum" (release)


@dataclass
class MeiConfig:
    every: int = 0  # compute MEI every K steps (0 = off)
    feature: str = "bias"  # bias | head
    threshold: str | float | None = None  # a number, or threshold.json from `meshrl mei calibrate`
    patience: int = 3  # warn when the batch MEI stays above the threshold this many steps


@dataclass
class DiagConfig:
    mei: MeiConfig = field(default_factory=MeiConfig)


@dataclass
class RunConfig:
    recipe: str = "grpo"
    algo: dict[str, Any] = field(default_factory=dict)  # overrides of the recipe's fields
    model: str = "tiny"
    task: str = "tiny:repeat"
    task_options: dict[str, Any] = field(default_factory=dict)
    steps: int = 20
    seed: int = 0
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    eval: EvalDuringTrainConfig = field(default_factory=EvalDuringTrainConfig)
    diag: DiagConfig = field(default_factory=DiagConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)  # docs/plugins.md

    @property
    def mesh_enabled(self) -> bool:
        return self.recipe in MESH_RECIPES

    @property
    def balance_mu(self) -> float:
        """Balancing strength in force: ``mesh.mu`` for ``mesh``, 0 for ``cp_only`` and the baselines."""
        return self.mesh.mu if self.recipe == "mesh" else 0.0

    def resolved_recipe(self) -> Recipe:
        """The recipe preset (``mesh.base`` for the Mesh recipes) with ``algo`` overrides applied."""
        base = self.mesh.base if self.mesh_enabled else self.recipe
        return recipe(base).replace(**self.algo)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["resolved_recipe"] = self.resolved_recipe().to_dict()
        if self.mesh_enabled:
            from meshrl.mesh.coach import COACH_PROMPT_VERSION, TEMPLATE_VERSION

            d["resolved_mesh"] = {"balance_mu": self.balance_mu, "coach_prompt_version": COACH_PROMPT_VERSION,
                                  "template_version": TEMPLATE_VERSION}
        return d

    def validate(self) -> RunConfig:
        if self.recipe not in RECIPES and self.recipe not in MESH_RECIPES:
            known = ", ".join(sorted([*RECIPES, *MESH_RECIPES]))
            raise ValueError(f"unknown recipe {self.recipe!r}; known: {known}")
        if self.mesh_enabled and self.mesh.base in MESH_RECIPES:
            raise ValueError(f"mesh.base must be a base recipe, got {self.mesh.base!r}")
        self.algo = _coerce_algo(self.algo)
        self.resolved_recipe()  # unknown algo fields and bases raise here
        self._validate_mesh()
        self._validate_choices()
        validate_plugins(self.plugins, self.resolved_recipe().policy_loss, self)
        bad = [k for k, ok in self._range_checks().items() if not ok]
        if bad:
            raise ValueError(f"invalid config value(s): {', '.join(f'{k}={get_key(self, k)!r}' for k in bad)}"
                             f" (allowed: {'; '.join(f'{k} {RANGES[k]}' for k in bad)})")
        return self

    def _range_checks(self) -> dict[str, bool]:
        r, o, t, e, m = self.rollout, self.optim, self.train, self.eval, self.diag.mei
        return {
            "steps": self.steps >= 0,
            "rollout.group_size": r.group_size >= 1,
            "rollout.prompts_per_step": r.prompts_per_step >= 1,
            "rollout.max_new_tokens": r.max_new_tokens >= 1,
            "rollout.temperature": r.temperature >= 0,
            "rollout.top_p": 0 < r.top_p <= 1,
            "rollout.batch_size": r.batch_size >= 1,
            "rollout.decode_workers": r.decode_workers >= 0,
            "optim.lr": o.lr > 0,
            "optim.warmup_steps": o.warmup_steps >= 0,
            "optim.min_lr_ratio": 0 <= o.min_lr_ratio <= 1,
            "optim.weight_decay": o.weight_decay >= 0,
            "optim.max_grad_norm": o.max_grad_norm > 0,
            "optim.beta1": 0 <= o.beta1 < 1,
            "optim.beta2": 0 <= o.beta2 < 1,
            "optim.eps": o.eps > 0,
            "train.ppo_epochs": t.ppo_epochs >= 1,
            "train.mini_batches": t.mini_batches >= 1,
            "train.micro_batch_size": t.micro_batch_size >= 1,
            "train.length_buckets": t.length_buckets >= 1,
            "train.update_workers": t.update_workers >= 0,
            "train.lora_r": t.lora_r >= 0,
            "train.lora_alpha": t.lora_alpha > 0,
            "reward.timeout_s": self.reward.timeout_s > 0,
            "dynamic_sampling.max_rounds": self.dynamic_sampling.max_rounds >= 1,
            "eval.every": e.every >= 0,
            "eval.n": e.n >= 1,
            "eval.limit": e.limit >= 0,
            "eval.temperature": e.temperature >= 0,
            "eval.max_new_tokens": e.max_new_tokens >= 0,
            "checkpoint.every": self.checkpoint.every >= 1,
            "checkpoint.keep_last": self.checkpoint.keep_last >= 1,
            "log.samples_per_step": self.log.samples_per_step >= -1,
            "failure.max_nonfinite": self.failure.max_nonfinite >= 1,
            "failure.max_stalled": self.failure.max_stalled >= 0,
            "diag.mei.every": m.every >= 0,
            "diag.mei.patience": m.patience >= 1,
        }

    def _validate_choices(self) -> None:
        choices = {"rollout.backend": (self.rollout.backend, ROLLOUT_BACKENDS),
                   "optim.schedule": (self.optim.schedule, LR_SCHEDULES),
                   "train.dtype": (self.train.dtype, DTYPES)}
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{key}={value!r}; known: {', '.join(allowed)}")
        for target in self.log.report_to:
            if target not in TRACKERS:
                raise ValueError(f"unknown --report-to target {target!r} (log.report_to); known: {', '.join(TRACKERS)}")

    def _validate_mesh(self) -> None:
        m = self.mesh
        choices = {"mesh.placement": (m.placement, ("system", "assistant")),
                   "mesh.budget": (m.budget, ("matched", "per_prefix")),
                   "mesh.template": (m.template, ("wrapped", "plain")),
                   "mesh.balance": (m.balance, ("paper", "support")),
                   "mesh.adv_unit": (m.adv_unit, ("prefix_group", "query")),
                   "mesh.reduction": (m.reduction, ("mean", "mean_active", "sum")),
                   "diag.mei.feature": (self.diag.mei.feature, ("bias", "head"))}
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{key}={value!r}; known: {', '.join(allowed)}")
        if m.m < 1 or m.mu < 0:
            raise ValueError(f"mesh.m must be >= 1 and mesh.mu >= 0, got m={m.m} mu={m.mu}")
        if m.bare_groups < 1:
            raise ValueError(f"mesh.bare_groups must be >= 1, got {m.bare_groups}")
        groups = m.m + (m.bare_groups if m.bare_group else 0)
        if self.mesh_enabled and m.budget == "matched" and self.rollout.group_size % groups:
            extra = f" + {m.bare_groups} (mesh.bare_group)" if m.bare_group else ""
            raise ValueError(f"matched budget needs rollout.group_size={self.rollout.group_size} divisible by "
                             f"mesh.m={m.m}{extra}")


def get_key(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part) if is_dataclass(obj) else obj[part]
    return obj


def _from_dict(cls: type, data: dict[str, Any] | None, where: str) -> Any:
    if data is None:  # a YAML section whose keys are all commented out
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config key {where or '<root>'} is a section: it must be a mapping of keys, got "
                         f"{type(data).__name__} {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    prefix = f"{where}." if where else ""
    if unknown:
        raise ValueError(f"unknown config key(s) {[f'{prefix}{k}' for k in unknown]}; known: {sorted(known)}")
    hints = get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        default = getattr(cls(), name)
        if is_dataclass(default):
            kwargs[name] = _from_dict(type(default), value, f"{prefix}{name}")
        else:
            kwargs[name] = _coerce(value, hints[name], f"{prefix}{name}")
    return cls(**kwargs)


def _coerce_algo(algo: dict[str, Any]) -> dict[str, Any]:
    """Type-check ``algo.*`` overrides against the :class:`Recipe` fields (unknown names raise later)."""
    hints = get_type_hints(Recipe)
    return {k: _coerce(v, hints[k], f"algo.{k}") if k in hints else v for k, v in algo.items()}


def _describe(hint: Any) -> str:
    names = {bool: "true/false", int: "an integer", float: "a finite number", str: "a string",
             type(None): "null"}
    if isinstance(hint, types.UnionType) or get_origin(hint) is Union:
        return " or ".join(_describe(h) for h in get_args(hint))
    if get_origin(hint) is list:
        return "a list"
    if get_origin(hint) is dict or hint is dict:
        return "a mapping"
    return names.get(hint, str(hint))


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check a YAML value against the field's type ``hint`` and convert what is unambiguous: ``1`` for a
    float field, ``4.0`` for an int one, ``"1e-5"`` (YAML 1.1 reads it as a string) for a number, a comma
    string for a list. Anything else raises ``ValueError`` naming the key, the expected type and the value."""
    if get_origin(hint) is not dict and hint is not dict and hint is not Any and isinstance(value, dict):
        raise ValueError(f"config key {key} is a value ({_describe(hint)}), not a section; got {value!r}")
    if isinstance(hint, types.UnionType) or get_origin(hint) is Union:
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, key)
            except ValueError:
                continue
        raise ValueError(f"config key {key} must be {_describe(hint)}, got {value!r}")
    converted = _convert(value, hint)
    if converted is _INVALID:
        raise ValueError(f"config key {key} must be {_describe(hint)}, got {value!r}")
    return converted


_INVALID = object()


def _convert(value: Any, hint: Any) -> Any:
    """``value`` as type ``hint``, or ``_INVALID``."""
    if hint is Any:
        return value
    if hint is bool:
        return value if isinstance(value, bool) else _INVALID
    if hint in (int, float):
        if isinstance(value, bool):
            return _INVALID
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                return _INVALID
        if not isinstance(value, int | float) or not math.isfinite(value):
            return _INVALID
        if hint is float:
            return float(value)
        return int(value) if float(value).is_integer() else _INVALID
    if hint is str:
        return value if isinstance(value, str) else _INVALID
    if get_origin(hint) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return _INVALID
        return value
    if get_origin(hint) is dict or hint is dict:
        return value if isinstance(value, dict) else _INVALID
    return value


def parse_override(text: str) -> tuple[str, Any]:
    """``"optim.lr=3e-4"`` -> ``("optim.lr", 3e-4)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ValueError(f"--set {text!r}: the key {key!r} is empty or has an empty part")
    try:
        return key, yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"--set {key}: cannot parse the value {raw!r} as YAML ({problem})") from None


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        if node.get(p) is None:  # absent, or a YAML section whose keys are all commented out
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise ValueError(f"--set {key}: {p} is not a section")
    node[parts[-1]] = value


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict[str, Any] | None = None
) -> RunConfig:
    """Build a validated :class:`RunConfig` from an optional YAML file, a base dict and overrides."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        loaded = read_yaml_mapping(Path(path), "config file")
        try:  # keys and types of the file alone first, so that its errors name the file
            _from_dict(RunConfig, _without_derived(loaded), "")
        except ValueError as e:
            raise ValueError(f"config file {path}: {e}") from None
        data = _deep_merge(data, loaded)
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    return _from_dict(RunConfig, _without_derived(data), "").validate()


def _without_derived(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the derived records ``config_record`` adds (a saved config.yaml loads back)."""
    return {k: v for k, v in data.items() if k not in ("resolved_recipe", "resolved_mesh", "resolved_task")}


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (PyYAML keeps the last one silently)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} repeats (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """Parse a YAML file holding a mapping; every failure is a ``ValueError`` naming the file (and line)."""
    if not path.is_file():
        raise ValueError(f"{what} not found: {path}" + (" (it is a directory)" if path.is_dir() else ""))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{what} {path}, line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x})") from None
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{what} {path}{where}: YAML syntax error: {problem}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{what} {path} must hold a mapping at the top level, got {type(loaded).__name__}")
    return loaded


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config_record(cfg: RunConfig, task: Any = None) -> dict[str, Any]:
    """The resolved config as written to ``config.yaml``; with ``task``, also ``resolved_task``: the reward kind it
    grades with and the answer-format instruction appended to every prompt (``null``: none), so a run records what
    it asked for."""
    d = cfg.to_dict()
    if task is not None:
        d["resolved_task"] = {"name": task.name, "reward_kind": task.reward_kind, "instruction": task.instruction}
    return d
