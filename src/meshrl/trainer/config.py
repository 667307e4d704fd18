"""Training configuration: nested dataclasses, YAML files and ``--set key=value`` overrides.

Every field is declared once with its default, help text and bounds (:func:`meshrl.settings.setting`); the range
checks, ``docs/config.md`` and ``meshrl train --help-config`` come from those declarations
(:mod:`meshrl.trainer.config_reference`).
Unknown keys are errors that name the key (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from meshrl.algos import ADVANTAGE_ESTIMATORS, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES, RECIPES, Recipe, recipe
from meshrl.models.loading import check_device
from meshrl.rollout import BACKENDS
from meshrl.settings import check_settings, section, setting
from meshrl.trainer.plugins import PluginsConfig, validate_plugins
from meshrl.trainer.schedule import SCHEDULES
from meshrl.yaml_files import deep_merge, read_yaml_mapping

ROLLOUT_BACKENDS = tuple(sorted(BACKENDS))  # the registry's: a registered backend is a choice (meshrl.rollout)
LR_SCHEDULES = SCHEDULES
DTYPES = ("float32", "bfloat16")
TRACKERS = ("tensorboard", "wandb", "trackio")
MESH_RECIPES = ("mesh", "cp_only")
STALENESS_CORRECTIONS = ("tis", "m2po", "none")


@dataclass
class RolloutConfig:
    backend: str = setting("auto", choices=ROLLOUT_BACKENDS,
                           help="sampler: native (meshrl's decode loop, Llama-family models), hf (transformers "
                                "generate), vllm; auto = vllm where installed and measured faster for the step's "
                                "shape (prompts x G x max_new_tokens; meshrl.rollout.choice), else native when the "
                                "model supports it, else hf")
    prompts_per_step: int = setting(8, ge=1, help="distinct problems per step")
    group_size: int = setting(8, ge=1, help="G: rollouts per problem (the GRPO group; Mesh splits it by prefix)")
    max_new_tokens: int = setting(64, ge=1, help="response length limit in tokens; longer responses are truncated")
    temperature: float = setting(1.0, ge=0, help="sampling temperature; the update's log-probs use the same one "
                                                 "(0 = greedy, scored at temperature 1)")
    top_p: float = setting(1.0, gt=0, le=1, help="nucleus sampling mass (1 = the whole distribution)")
    batch_size: int = setting(64, ge=1, help="prompts per generate call (a memory bound)")
    decode_workers: int = setting(0, ge=0, help="native backend on a CPU: decoder processes in parallel "
                                                "(0 = one per torch thread)")
    autocast_bf16: bool = setting(False, help="hf/native: sample under bf16 autocast (the update's precision is "
                                              "train.autocast_bf16; the gap is logged as mismatch/*); emulated and "
                                              "slow on a CPU without AVX-512 (warned at start)")
    prepack_weights: bool = setting(True, help="native on a CPU: oneDNN-reordered weight copies per generate call "
                                               "(faster; bf16 bit-identical, float32 rounds differently; float32 "
                                               "copies under bf16 autocast where oneDNN lacks bf16 kernels)")
    decoder: str = setting("auto", choices=("auto", "static", "dynamic"),
                           help="native: static = preallocated KV cache kept between steps, the decode step "
                                "replayed as a CUDA graph (meshrl.rollout.static_decode; eager on a CPU: the GPU "
                                "path's twin); dynamic = per-step shapes; auto = static on a CUDA device, else "
                                "dynamic")
    keep_decoders: bool = setting(True, help="native: keep the decoder processes (CPU) and the static decoder's "
                                             "KV cache and graphs (GPU) between steps; false: built again each "
                                             "rollout, none held during the update (less memory)")
    max_staleness: int = setting(0, ge=0, le=64,
                                 help="k: the batch of step s is sampled from the weights of step max(0, s - k) "
                                      "while the steps before it update (0 = sample, then update; "
                                      "meshrl.trainer.lagged_rollouts, docs/training.md)")
    staleness_correction: str = setting("tis", choices=STALENESS_CORRECTIONS,
                                        help="with max_staleness >= 1: tis = truncated importance weights "
                                             "pi_update / pi_sampler (plugins.rollout_corr), m2po = the ratio taken "
                                             "against the sampler and M2PO's mask (plugins.m2po), none")
    sampler_process: str = setting("auto", choices=("auto", "process", "inline"),
                                   help="with max_staleness >= 1: process = a forked sampler overlapping the "
                                        "update (CPU); inline = the same batches sampled in turn, no overlap; "
                                        "auto = process where forking is safe (a CPU policy), else inline")
    sampler_threads: int = setting(0, ge=0, help="with max_staleness >= 1: cores of the sampler (the native "
                                                 "decoder's worker processes; other backends use one); the update "
                                                 "keeps the rest (0 = half of the torch threads, at least 1)")
    sampler_timeout_s: float = setting(1800.0, gt=0, help="with max_staleness >= 1: end the run when the sampler "
                                                          "has sent nothing for this long")


@dataclass
class OptimConfig:
    lr: float = setting(1e-5, gt=0, help="AdamW learning rate (peak, after warm-up)")
    warmup_steps: int = setting(0, ge=0, help="linear warm-up over this many training steps")
    schedule: str = setting("constant", choices=LR_SCHEDULES,
                            help="after warm-up: constant, linear or cosine decay to lr * min_lr_ratio at the last "
                                 "step (meshrl.trainer.schedule)")
    min_lr_ratio: float = setting(0.0, ge=0, le=1, help="where linear and cosine end, as a share of lr")
    weight_decay: float = setting(0.0, ge=0, help="AdamW weight decay (decoupled)")
    max_grad_norm: float = setting(1.0, gt=0, help="clip the gradient's global L2 norm to this before each step")
    beta1: float = setting(0.9, ge=0, lt=1, help="AdamW beta1")
    beta2: float = setting(0.999, ge=0, lt=1, help="AdamW beta2")
    eps: float = setting(1e-8, gt=0, help="AdamW epsilon")


@dataclass
class TrainConfig:
    ppo_epochs: int = setting(1, ge=1, help="passes over each step's rollouts")
    mini_batches: int = setting(1, ge=1, help="optimiser steps per epoch (1 with one epoch: on-policy, no old-"
                                              "policy forward)")
    micro_batch_size: int = setting(16, ge=1, help="sequences per forward/backward (gradient accumulation, exact "
                                                   "for every aggregation mode)")
    dtype: str = setting("float32", choices=DTYPES, help="model weights' dtype")
    device: str = setting("cpu", help="where the policy (and its reference) live: cpu, cuda, cuda:N, or auto "
                                      "(cuda when torch sees one, else cpu); the in-process samplers run there "
                                      "too")
    autocast_bf16: bool = setting(False, help="bf16 autocast for the update's forward passes; emulated and slow on "
                                              "a CPU without AVX-512 (warned at start)")
    speed: str = setting("auto", choices=("auto", "plain"),
                         help="the update's speed path (meshrl.trainer.speed): auto = by train.device, each saving "
                              "behind its own setting below; plain = the model's own forward, one padded pass, whole "
                              "logits, no memory management (the reference the fast paths are tested equal to)")
    share_prompts: bool = setting(True, help="run each distinct prompt once per micro-batch and share its KV "
                                             "cache (same logits up to float rounding)")
    pack_responses: bool = setting(True, help="Llama-family: pack the responses of one prompt into rows under a "
                                              "block-diagonal mask")
    length_buckets: int = setting(2, ge=1, help="other models: response-length groups per micro-batch, each "
                                                "padded to its longest")
    head_chunk: int = setting(512, ge=0, help="tokens per chunk of the output head for log-probs and entropies, "
                                           "recomputed in the backward (0 = the whole [n, T, V] logits at once)")
    head_keep_mib: int = setting(128, ge=0, help="a plain linear head keeps its logits for the backward up to this "
                                                 "many MiB per micro-batch instead of recomputing them (same values)")
    lean_activations: bool = setting(True, help="Llama-family: the update's backward recomputes RMSNorm and SwiGLU "
                                                "intermediates instead of keeping them (same gradients)")
    float32_attention: bool = setting(True, help="CPU, bf16 autocast: the update's attention in float32 (PyTorch's "
                                                 "bf16 flash-attention backward is slower there; closer to exact; "
                                                 "benchmarks/README.md)")
    heap_mmap_kib: int = setting(0, ge=0, help="C allocations of at least this many KiB get their own mapping "
                                               "(glibc; 0 = dynamic); less resident memory, slower steps "
                                               "(benchmarks/README.md, \"Memory\")")
    update_workers: int = setting(0, ge=0, help="CPU: processes sharing each micro-batch (0 = one per torch thread, "
                                                "up to 16M trainable parameters; 1 = one process)")
    skip_zero_advantage: bool = setting(True, help="rows with advantage 0 run forward only when their gradient is "
                                                   "exactly 0 (the policy term alone, or times TIS / M2PO factors)")
    lora_r: int = setting(0, ge=0, help="LoRA rank (peft); 0 = full fine-tuning")
    lora_alpha: int = setting(16, gt=0, help="LoRA alpha (the adapter's scale is alpha / r)")


@dataclass
class RewardConfig:
    timeout_s: float = setting(5.0, gt=0, help="seconds a reward function may take per rollout (then reward 0, "
                                               "counted)")
    strict: bool = setting(False, help="an error or timeout in a reward function aborts the run instead of "
                                       "scoring 0")
    sandbox_allow_weak: bool = setting(False, help="run model-written code (code tasks) even where bubblewrap cannot "
                                                   "confine it: the program could then forge its reward, read the "
                                                   "tests and harm the machine (docs/reliability.md)")


@dataclass
class DynamicSamplingConfig:
    max_rounds: int = setting(4, ge=1, help="DAPO: generation rounds per step to refill the groups filtered out")


@dataclass
class EvalDuringTrainConfig:
    every: int = setting(0, ge=0, help="evaluate on the held-out split every E steps and at the last step "
                                       "(0 = off)")
    split: str = setting("eval", help="the task's split to evaluate on")
    n: int = setting(4, ge=1, help="samples per held-out problem")
    limit: int = setting(64, ge=0, help="held-out problems (0 = all)")
    temperature: float = setting(1.0, ge=0, help="sampling temperature of the evaluation")
    max_new_tokens: int = setting(0, ge=0, help="response limit of the evaluation (0 = rollout.max_new_tokens)")
    at_start: bool = setting(False, help="also evaluate the starting policy, as step 0 of evals.jsonl (not on "
                                         "resume; sampled with its own seed: the training steps are unchanged)")
    by: str = setting("", help="a problem meta field to break held-out accuracy down by (e.g. type): "
                               "eval/by/<value>/mean@1 and eval/by/<value>/problems; problems without it count "
                               "under 'none'")


@dataclass
class CheckpointConfig:
    every: int = setting(10, ge=1, help="write a checkpoint every this many steps (and at the last step)")
    keep_last: int = setting(2, ge=1, help="checkpoints kept (older ones pruned; best and final are named in "
                                           "summary.json)")


@dataclass
class LogConfig:
    samples_per_step: int = setting(4, ge=-1, help="rollouts written to samples.jsonl per step (-1 = all, e.g. for "
                                                   "meshrl census)")
    report_to: list[str] = setting(factory=list, choices=TRACKERS, help="trackers besides metrics.jsonl: "
                                                                        "tensorboard, wandb, trackio")
    progress: bool = setting(True, help="a progress bar on a terminal, plain lines otherwise")


@dataclass
class FailureConfig:
    max_nonfinite: int = setting(3, ge=1, help="stop (with a checkpoint) after this many non-finite steps in a row")
    max_stalled: int = setting(3, ge=0, help="stop after this many steps in a row with zero gradient and non-zero "
                                             "advantages (0 = off)")
    max_reward_failed: int = setting(3, ge=0, help="stop after this many steps in a row in which every reward call "
                                                   "raised, timed out or returned NaN, a non-number or a value "
                                                   "outside [0, 1] (0 = off)")


@dataclass
class HealthConfig:
    every: int = setting(0, ge=0, help="run meshrl doctor's checks on the run's records every this many steps (0 = "
                                       "off); findings go to events.jsonl (docs/doctor.md, 'During training')")
    on: dict[str, str] = setting(factory=dict, help="action per finding id or severity (alarm, warning, info): "
                                                    "ignore, warn, checkpoint, stop; e.g. health.on.alarm=stop. "
                                                    "Unnamed: alarm and warning warn, info is ignored")
    thresholds: dict[str, Any] = setting(factory=dict, help="the doctor's thresholds overridden by name "
                                                            "(meshrl.doctor.Thresholds), e.g. "
                                                            "health.thresholds.kl_max=0.5")


@dataclass
class MeshConfig:
    """Coach Prompting + Strategy-Balancing (recipes ``mesh`` and ``cp_only``; docs/method.md §1.3)."""

    base: str = setting("grpo", help="the GRPO-family recipe underneath (the paper's Mesh is GRPO-based)")
    prefixes: str | None = setting(None, help="prefixes.jsonl from `meshrl coach`; null = the task's own rule "
                                              "strategies")
    m: int = setting(4, ge=1, help="strategies (prefix groups) per query")
    placement: str = setting("system", choices=("system", "assistant"),
                             help="system: the prefix in the system prompt (the paper's release); assistant: it "
                                  "opens the assistant turn, outside every loss term")
    template: str = setting("wrapped", choices=("wrapped", "plain"),
                            help="wrapped: the anti-hacking template; plain: the prefix text alone (small models "
                                 "trained on bare prefixes)")
    budget: str = setting("matched", choices=("matched", "per_prefix"),
                          help="matched: m groups of G/m (the baseline's rollouts); per_prefix: m groups of G")
    adv_unit: str = setting("prefix_group", choices=("prefix_group", "query"),
                            help="advantage normalisation unit: each prefix group (the release) or the whole query")
    mu: float = setting(1e-5, ge=0, help="balancing strength (cp_only forces 0)")
    balance: str = setting("paper", choices=("paper", "support"),
                           help="paper: KL(uniform || softmax(z - z_ref)) on the conditioned log-probs; support: "
                                "meshrl's one-sided extension on the unconditioned ones (meshrl.mesh.support)")
    bare_group: bool = setting(False, help="also sample prefix-free groups, so the policy that runs at test time is "
                                           "trained too (matched budget: m + bare_groups groups share G)")
    bare_groups: int = setting(1, ge=1, help="prefix-free groups per query when bare_group is on")
    subtract_ref: bool = setting(True, help="r = z - z_ref (the paper); false = the release variant without the "
                                            "reference")
    reduction: str = setting("mean", choices=("mean", "mean_active", "sum"),
                             help="over queries: mean (all queries), mean_active, or sum (the release)")


@dataclass
class MeiConfig:
    every: int = setting(0, ge=0, help="compute MEI every K steps (0 = off), from the sampler's distributions "
                       "(native, hf), else from the update's logits")
    feature: str = setting("bias", choices=("bias", "head"),
                           help="feature map: bias (online); head (offline: meshrl mei calibrate, census)")
    threshold: str | float | None = setting(None, help="a number, or threshold.json from `meshrl mei calibrate`; "
                                                       "null = no warning")
    patience: int = setting(3, ge=1, help="warn when the batch MEI stays above the threshold this many checks")


@dataclass
class DiagConfig:
    mei: MeiConfig = section(MeiConfig, "the MEI early-warning index (docs/diagnostics.md)")


ALGO_CHOICES = {"advantage": ADVANTAGE_ESTIMATORS, "policy_loss": POLICY_LOSSES, "loss_agg": AGG_MODES,
                "kl_kind": KL_ESTIMATORS}  # registries: looked up when the config is checked


@dataclass
class AlgoConfig:
    """Overrides of the recipe's fields (``meshrl.algos.Recipe``); null keeps the recipe's value."""

    advantage: str | None = setting(None, help="advantage estimator (meshrl.algos registry): grpo, dr_grpo")
    adv_scale: str | None = setting(None, choices=("std", "none"),
                                    help="std: divide by the group's std (GRPO); none: mean-centred only (Dr. GRPO)")
    policy_loss: str | None = setting(None, help="policy loss (meshrl.algos registry): ppo_clip, gspo, gspo_token, "
                                                 "cispo")
    clip_low: float | None = setting(None, ge=0, help="eps_low of the ratio clip (1 - eps_low)")
    clip_high: float | None = setting(None, ge=0, help="eps_high of the ratio clip (1 + eps_high; DAPO's "
                                                       "clip-higher: 0.28)")
    clip_dual: float | None = setting(None, gt=1, help="dual-clip constant c for negative advantages (null = none)")
    loss_agg: str | None = setting(None, help="aggregation: seq-mean-token-mean, token-mean, seq-mean-token-sum, "
                                              "seq-mean-token-sum-norm, token-sum")
    kl_coef: float | None = setting(None, ge=0, help="beta of KL(pi || pi_ref) in the loss (0 = no KL term)")
    kl_kind: str | None = setting(None, help="KL estimator: k1, k2, k3, low_var_kl, ...")
    js_coef: float | None = setting(None, ge=0, help="beta of JS(pi, pi_ref) in the loss (0 = none)")
    js_mode: str | None = setting(None, choices=("exact", "sampled"),
                                  help="exact: over the vocabulary; sampled: from the sampled tokens' log-probs")
    dynamic_sampling: bool | None = setting(None, help="DAPO: drop groups whose rewards are all equal and refill")
    overlong_shaping: bool | None = setting(None, help="DAPO's soft overlong punishment added to the reward")
    overlong_cache_frac: float | None = setting(None, gt=0, le=1, help="L_cache / L_max of the overlong punishment")
    overlong_factor: float | None = setting(None, ge=0, help="scale of the overlong punishment")

    def overrides(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class RunConfig:
    recipe: str = setting("grpo", help="grpo, dr_grpo, grpo_kl, grpo_js, dapo, gspo, gspo_token, cispo, or mesh / "
                                       "cp_only (with mesh.base underneath)")
    algo: AlgoConfig = section(AlgoConfig, "the recipe's fields, overridden one by one (null: the recipe's value)")
    model: str = setting("tiny", help="tiny, tiny:small, smollm2-135m, or a local Hugging Face directory")
    task: str = setting("tiny:repeat", help="tiny:repeat, tiny:add, testbed:add, rg:NAME, jsonl:PATH?..., "
                                            "parquet:PATH?..., math500, gsm8k (docs/training.md)")
    task_options: dict[str, Any] = setting(factory=dict, help="keyword options of the task's constructor")
    steps: int = setting(20, ge=0, help="total training steps (with --resume: continue to this total)")
    seed: int = setting(0, help="seed of the weights' initialisation, the problem order and sampling")
    rollout: RolloutConfig = section(RolloutConfig, "sampling the step's rollouts")
    optim: OptimConfig = section(OptimConfig, "AdamW and the learning-rate schedule")
    train: TrainConfig = section(TrainConfig, "the update: epochs, batches, precision, LoRA, speed paths")
    reward: RewardConfig = section(RewardConfig, "running the reward functions")
    dynamic_sampling: DynamicSamplingConfig = section(DynamicSamplingConfig, "DAPO's dynamic sampling")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoints in RUN_DIR/checkpoints")
    log: LogConfig = section(LogConfig, "records and trackers")
    failure: FailureConfig = section(FailureConfig, "when a run stops itself")
    mesh: MeshConfig = section(MeshConfig, "Mesh Learning (recipes mesh and cp_only; docs/mesh.md)")
    eval: EvalDuringTrainConfig = section(EvalDuringTrainConfig, "held-out evaluation during training")
    diag: DiagConfig = section(DiagConfig, "diagnostics during training")
    health: HealthConfig = section(HealthConfig, "meshrl doctor's checks during training (docs/doctor.md)")
    plugins: PluginsConfig = section(PluginsConfig, "the reading list's techniques (docs/plugins.md)")

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
        resolved = recipe(base).replace(**self.algo.overrides())
        if resolved.advantage == "dr_grpo" and self.algo.adv_scale is None:
            resolved = resolved.replace(adv_scale="none")  # what dr_grpo computes; config.yaml records it
        return resolved

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["algo"] = self.algo.overrides()  # only what was set: config.yaml reads as the overrides it records
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
        for key, registry in ALGO_CHOICES.items():
            value = getattr(self.algo, key)
            if value is not None and value not in registry:
                raise ValueError(f"algo.{key}={value!r}; known: {', '.join(registry)}")
        resolved = self.resolved_recipe()  # unknown bases raise here
        if resolved.advantage == "dr_grpo" and self.algo.adv_scale == "std":
            # dr_grpo's estimator never divides by the std: running it would silently ignore adv_scale=std.
            raise ValueError("algo.advantage=dr_grpo (Dr. GRPO: no std division) contradicts algo.adv_scale=std; "
                             "use algo.advantage=grpo with adv_scale=std, or adv_scale=none")
        bad = [(k, v, allowed) for k, v, allowed in check_settings(self) if not k.startswith("plugins.")]
        if bad:
            for key, value, allowed in bad:
                if key == "log.report_to":
                    unknown = next(t for t in value if t not in TRACKERS)
                    raise ValueError(f"unknown --report-to target {unknown!r} (log.report_to); known: "
                                     f"{', '.join(TRACKERS)}")
                if allowed.startswith("one of "):
                    raise ValueError(f"{key}={value!r}; known: {allowed.removeprefix('one of ')}")
            raise ValueError(f"invalid config value(s): {', '.join(f'{k}={v!r}' for k, v, _ in bad)}"
                             f" (allowed: {'; '.join(f'{k} {a}' for k, _, a in bad)})")
        self._validate_mesh()
        self._validate_health()
        if self.rollout.max_staleness:
            from meshrl.trainer.lagged_rollouts import check_staleness

            check_staleness(self)
        check_device(self.train.device)
        validate_plugins(self.plugins, self.resolved_recipe().policy_loss, self)
        return self

    def _validate_health(self) -> None:
        from meshrl.doctor import DEFAULT
        from meshrl.doctor.live import check_actions

        check_actions(self.health.on)
        try:
            DEFAULT.with_overrides(self.health.thresholds)
        except (TypeError, ValueError) as e:
            raise ValueError(f"health.thresholds: {e}") from None

    def _validate_mesh(self) -> None:
        m = self.mesh
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
        data = deep_merge(data, loaded)
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    return _from_dict(RunConfig, _without_derived(data), "").validate()


def _without_derived(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the derived records ``config_record`` adds (a saved config.yaml loads back)."""
    return {k: v for k, v in data.items() if k not in ("resolved_recipe", "resolved_mesh", "resolved_task")}


def config_record(cfg: RunConfig, task: Any = None) -> dict[str, Any]:
    """The resolved config as written to ``config.yaml``; with ``task``, also ``resolved_task``: the reward kind it
    grades with and the answer-format instruction appended to every prompt (``null``: none), so a run records what
    it asked for."""
    d = cfg.to_dict()
    if task is not None:
        d["resolved_task"] = {"name": task.name, "reward_kind": task.reward_kind, "instruction": task.instruction}
    return d
