"""Training configuration: nested dataclasses, YAML files and ``--set key=value`` overrides.

Unknown keys are errors that name the key (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from meshrl.algos import RECIPES, Recipe, recipe


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


@dataclass
class OptimConfig:
    lr: float = 1e-5
    warmup_steps: int = 0  # linear warm-up over training steps
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


MESH_RECIPES = ("mesh", "cp_only")


@dataclass
class MeshConfig:
    """Coach Prompting + Strategy-Balancing (recipes ``mesh`` and ``cp_only``; DESIGN.md §1.3)."""

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
        self.resolved_recipe()  # unknown algo fields and bases raise here
        self._validate_mesh()
        checks = {
            "steps": self.steps >= 0,
            "rollout.group_size": self.rollout.group_size >= 1,
            "rollout.prompts_per_step": self.rollout.prompts_per_step >= 1,
            "rollout.max_new_tokens": self.rollout.max_new_tokens >= 1,
            "rollout.temperature": self.rollout.temperature >= 0,
            "rollout.top_p": 0 < self.rollout.top_p <= 1,
            "optim.lr": self.optim.lr > 0,
            "train.ppo_epochs": self.train.ppo_epochs >= 1,
            "train.mini_batches": self.train.mini_batches >= 1,
            "train.micro_batch_size": self.train.micro_batch_size >= 1,
            "train.length_buckets": self.train.length_buckets >= 1,
            "rollout.decode_workers": self.rollout.decode_workers >= 0,
            "train.update_workers": self.train.update_workers >= 0,
            "checkpoint.every": self.checkpoint.every >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid config value(s): {', '.join(f'{k}={get_key(self, k)!r}' for k in bad)}")
        return self


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


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or '<root>'} must be a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown config key(s) {[f'{where}{k}' for k in unknown]}; known: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        default = getattr(cls(), name)
        if is_dataclass(default):
            kwargs[name] = _from_dict(type(default), value, f"{where}{name}.")
        else:
            kwargs[name] = _coerce(value, default, f"{where}{name}")
    return cls(**kwargs)


def _coerce(value: Any, default: Any, key: str) -> Any:
    """Make YAML scalars match the default's type (``1`` for a float field, ``"1e-5"`` strings...)."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise ValueError(f"config key {key} must be true/false, got {value!r}")
    if isinstance(default, int | float) and isinstance(value, str):
        try:
            value = float(value)
        except ValueError as e:
            raise ValueError(f"config key {key} must be a number, got {value!r}") from e
    if isinstance(default, float) and isinstance(value, int | float):
        return float(value)
    if isinstance(default, int) and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(default, list) and isinstance(value, str):
        return [v for v in value.split(",") if v]
    return value


def parse_override(text: str) -> tuple[str, Any]:
    """``"optim.lr=3e-4"`` -> ``("optim.lr", 3e-4)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {key}: {p} is not a section")
    node[parts[-1]] = value


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict[str, Any] | None = None
) -> RunConfig:
    """Build a validated :class:`RunConfig` from an optional YAML file, a base dict and overrides."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {p} must hold a mapping at the top level")
        data = _deep_merge(data, loaded)
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    data.pop("resolved_recipe", None)
    data.pop("resolved_mesh", None)
    return _from_dict(RunConfig, data, "").validate()


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
