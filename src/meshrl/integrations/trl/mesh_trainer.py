"""``MeshGRPOTrainer``: Mesh Learning (Coach Prompting + Strategy Balancing) inside TRL's ``GRPOTrainer``.

What the subclass changes, at three override points of trl 1.16 (docs/scale-out.md, "TRL"):

- ``_generate_and_score_completions``: each query's block of ``num_generations`` completions is cut into
  prefix groups (``MeshOptions.layout``); every rollout's prompt is conditioned on its group's coach prefix
  before generation, so the prefix is prompt, never completion. Afterwards the batch carries per-completion
  ``strategy_ids`` / ``query_ids``; advantages are recomputed per prefix group (``adv_unit="prefix_group"``);
  the balancing weights ``w_j = dJ/d seq_logp_j`` are computed once from the detached, gathered log-probs
  (:func:`meshrl.mesh.strategy_balance_row_weights`, or :func:`meshrl.mesh.support_balance_row_weights`).
- ``_compute_loss``: adds ``W * sum_j w_j seq_logp_j`` over the micro-batch, where ``seq_logp`` has the
  gradient of TRL's own forward (captured from ``_get_per_token_logps_and_entropies``, no second forward)
  and ``W`` is the number of processes (DDP averages gradients; TRL's loss is already scaled for gradient
  accumulation). Summed over the micro-batches of a step this is exactly ``grad J``, as in meshrl's trainer.
- ``_generate_single_turn``: vLLM server mode de-duplicates prompts with stride ``num_generations``; the
  stride is the prefix-group size here, since prompts now change inside a query's block.

Evaluation (``mode == "eval"``) runs unconditioned: the test-time policy has no coach.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather, gather_object, is_peft_model
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import is_conversational

from meshrl.integrations.trl.options import MeshOptions, check_trl_version, trl_group_advantages
from meshrl.integrations.trl.prompt_lengths import fitting_rows, subset
from meshrl.mesh import load_prefixes, query_key, strategy_balance_row_weights, support_balance_row_weights

log = logging.getLogger("meshrl")


def prefixes_for_dataset(dataset, table: dict[str, list[str]], m: int, column: str, path: Path) -> None:
    """``ValueError`` naming the prefix file and the first rows whose problem has no ``m`` prefixes in it."""
    if not hasattr(dataset, "__len__"):
        raise ValueError("MeshGRPOTrainer needs a map-style train_dataset (datasets.Dataset): every problem's "
                         f"prefixes are checked against {path} before training")
    names = getattr(dataset, "column_names", None)
    if names is not None and column not in names:
        raise ValueError(f"train_dataset has no column {column!r} (MeshOptions.problem_column) to look the coach "
                         f"prefixes up by; columns: {', '.join(names)}")
    missing = []
    for i, row in enumerate(dataset):
        text = row.get(column)
        if not isinstance(text, str) or len(table.get(query_key(text), ())) < m:
            missing.append(str(row.get("query_id", i)))
    if missing:
        raise ValueError(f"{len(missing)} of {len(dataset)} dataset rows have no {m} prefixes in prefix file {path} "
                         f"(matched on the {column!r} column; first: {', '.join(missing[:5])}); rerun `meshrl "
                         "coach` on the same task or export the dataset with `meshrl export trl`")


class MeshGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` running Mesh Learning from a ``meshrl coach`` prefix file.

    Args (besides ``GRPOTrainer``'s):
        prefixes: path of the prefix file (JSONL from ``meshrl coach``), keyed by the problem text.
        mesh: :class:`MeshOptions` (m, placement, template, budget, adv_unit, mu, balance, subtract_ref, ...).

    Every problem of ``train_dataset`` must have ``m`` prefixes in the file, and ``args.num_generations``
    must divide into the prefix groups; both are checked here, before any step. Rows whose prompt with a
    prefix does not fit the model's positions with ``max_completion_length`` are dropped here with a warning
    and counted (``skipped/long_prompts``), as meshrl's trainer skips them (``prompt_lengths``). Metrics (``mesh/*``,
    ``rollouts/count``) carry the names of meshrl's trainer; ``mesh/grad_ratio`` is not logged (the
    balancing gradient shares TRL's backward).
    """

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, *,
                 prefixes: str | os.PathLike, mesh: MeshOptions | None = None, **kwargs: Any) -> None:
        check_trl_version()
        self.mesh = mesh if mesh is not None else MeshOptions()
        if not isinstance(self.mesh, MeshOptions):
            raise ValueError(f"mesh must be a MeshOptions, got {type(self.mesh).__name__}")
        if args is None:
            raise ValueError("MeshGRPOTrainer needs args=GRPOConfig(...): num_generations sets the rollouts per query")
        if getattr(args, "use_vllm", False) and args.vllm_mode == "server" and (args.use_cpu
                                                                             or not torch.cuda.is_available()):
            # TRL connects to the server first and fails only then, in VLLMClient.init_communicator.
            raise ValueError("GRPOConfig(use_vllm=True, vllm_mode='server') needs CUDA: TRL syncs the weights into "
                             "the server through vLLM's NCCL weight transfer; on a CPU use vllm_mode='colocate' "
                             "(docs/scale-out.md)")
        self.mesh_group_size, self.mesh_strategies = self.mesh.layout(args.num_generations)
        if self.mesh.adv_unit == "prefix_group" and args.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError("mesh.adv_unit='prefix_group' recomputes TRL's 'sum_then_normalize' advantage; "
                             f"GRPOConfig.multi_objective_aggregation={args.multi_objective_aggregation!r}")
        path = Path(prefixes)
        if not path.is_file():
            raise ValueError(f"prefix file not found: {path}")
        if train_dataset is None:
            raise ValueError("MeshGRPOTrainer needs a train_dataset (one row per query)")
        self.mesh_table = load_prefixes(path)
        self.mesh_prefix_file = path
        prefixes_for_dataset(train_dataset, self.mesh_table, self.mesh.m, self.mesh.problem_column, path)
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        keep, self.mesh_too_long = fitting_rows(self, train_dataset)  # needs the tokenizer TRL resolved
        self.train_dataset = subset(train_dataset, keep)
        self._mesh_correct_index = self._correct_reward_index()
        self._mesh_capture: list[torch.Tensor] | None = None
        self._mesh_rewards: torch.Tensor | None = None
        self._mesh_ref_model = self._reference_model() if self._needs_own_reference() else None
        colocated = getattr(self.args, "use_vllm", False) and self.args.vllm_mode == "colocate"
        if colocated and not torch.cuda.is_available():
            self.vllm_generation.sync_weights = self._sync_vllm_by_reload

    def _sync_vllm_by_reload(self) -> None:
        """Colocated vLLM on a CPU: TRL's sync calls the engine model's ``load_weights`` directly, which vLLM's CPU
        build cannot take once it has repacked its linear weights for oneDNN / sgl-kernel (they become empty
        parameters without a ``weight_loader``: ``AttributeError``). The same tensors, named and gathered by TRL
        (LoRA merged), go in through ``collective_rpc("reload_weights")`` instead, as meshrl's own vLLM backend does
        (meshrl.rollout.vllm_backend)."""
        gen = self.vllm_generation
        weights = [(name, param.detach().clone()) for name, param in gen._iter_named_params()]  # clone: LoRA unmerges
        gen.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        gen.llm.reset_prefix_cache()

    # ---- set-up -------------------------------------------------------------------------------------------
    def _correct_reward_index(self) -> int:
        names = list(self.reward_func_names)
        if self.mesh.correct_reward is None:
            if len(names) != 1:
                raise ValueError(f"{len(names)} reward functions ({', '.join(names)}): set MeshOptions.correct_reward "
                                 "to the one whose value marks a completion correct")
            return 0
        if self.mesh.correct_reward not in names:
            raise ValueError(f"MeshOptions.correct_reward={self.mesh.correct_reward!r} is not a reward function of "
                             f"this trainer ({', '.join(names)})")
        return names.index(self.mesh.correct_reward)

    def _needs_own_reference(self) -> bool:
        """The paper form with ``subtract_ref`` needs reference log-probs; TRL has a reference only for beta > 0."""
        return (self.mesh.balance == "paper" and self.mesh.mu > 0 and self.mesh.subtract_ref
                and self.beta == 0.0 and not is_peft_model(self.model))

    def _reference_model(self):
        """A frozen copy of the initial policy built as TRL builds its own (from the model's path)."""
        from trl.models import prepare_deepspeed, prepare_fsdp
        from trl.trainer.utils import add_fused_lm_head, create_model_from_path, get_config_model_id

        model_id = get_config_model_id(self.model.config)
        if not model_id or not Path(model_id).exists() and "/" not in model_id:
            raise ValueError("mesh.subtract_ref=True with GRPOConfig.beta=0 needs a reference model loadable from the "
                             f"policy's path, got {model_id!r}: pass the model as a path, set beta > 0, use PEFT, "
                             "or set MeshOptions(subtract_ref=False)")
        kwargs = dict(self.args.model_init_kwargs or {})
        if self.args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
            kwargs["device_map"] = None
        kwargs.setdefault("dtype", self.model.dtype)
        ref = create_model_from_path(model_id, **kwargs)
        ref.eval().requires_grad_(False)
        add_fused_lm_head(ref, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(ref, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(ref, self.accelerator)
        return self.accelerator.prepare_model(ref, evaluation_mode=True)

    # ---- generation: conditioning and ids -----------------------------------------------------------------
    def _mesh_rows(self, inputs: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(global query block, strategy id) of each local row; checks that TRL's blocks hold one problem."""
        start = self.accelerator.process_index * len(inputs)
        g = self.num_generations
        keys = gather_object([query_key(x[self.mesh.problem_column]) for x in inputs])
        for b in range(0, len(keys), g):
            if len(set(keys[b:b + g])) != 1:
                raise RuntimeError(f"generation batch rows {b}..{b + g - 1} hold more than one problem: TRL's "
                                   "RepeatSampler layout (num_generations consecutive rows per query) is broken")
        queries = [(start + i) // g for i in range(len(inputs))]
        strategies = [self.mesh.strategy_of((start + i) % g, g) for i in range(len(inputs))]
        return queries, strategies

    def _condition(self, row: dict[str, Any], strategy: int) -> dict[str, Any]:
        if strategy < 0:
            return row
        prefix = self.mesh_table[query_key(row[self.mesh.problem_column])][strategy]
        return {**row, "prompt": self.mesh.conditioned_prompt(row["prompt"], prefix)}

    def _tokenize_prompts(self, prompts: list):
        """Render prompts that end with an assistant message (``placement="assistant"``) as its continuation."""
        if not (is_conversational({"prompt": prompts[0]}) and any(p[-1]["role"] == "assistant" for p in prompts)):
            return super()._tokenize_prompts(prompts)
        if self._is_vlm or self.tools:
            raise ValueError("mesh.placement='assistant' supports text-only prompts without tools")
        ids = []
        for p in prompts:
            last = p[-1]["role"] == "assistant"
            out = self.processing_class.apply_chat_template(
                conversation=p, chat_template=self.chat_template, add_generation_prompt=not last,
                continue_final_message=last, tokenize=True, return_dict=True, **self.chat_template_kwargs)
            ids.append(list(out["input_ids"]))
        return ids, None, {}

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # vLLM server mode generates `num_generations` completions for every `num_generations`-th prompt; prompts
        # are constant within a prefix group only. Colocate mode and transformers ignore this stride.
        if self.model.training:
            num_generations = self.mesh_group_size
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._mesh_rewards = rewards  # [N, F] gathered over processes (TRL's contract)
        return rewards

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        queries, strategies = self._mesh_rows(inputs)
        conditioned = [self._condition(x, k) for x, k in zip(inputs, strategies, strict=True)]
        out = super()._generate_and_score_completions(conditioned)
        device = out["advantages"].device
        out["strategy_ids"] = torch.tensor(strategies, device=device)
        out["query_ids"] = torch.tensor(queries, device=device)
        local = slice(self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs))
        rewards = self._mesh_rewards
        weighted = (rewards * self.reward_weights.to(rewards.device).unsqueeze(0)).nansum(dim=1)
        weighted[torch.isnan(rewards).all(dim=1)] = torch.nan
        if self.mesh.adv_unit == "prefix_group":
            adv = trl_group_advantages(weighted, self.mesh_group_size, self.scale_rewards)
            out["advantages"] = adv[local].to(out["advantages"].dtype).to(device)
        all_strategies = gather(out["strategy_ids"])
        correct = (torch.nan_to_num(rewards[:, self._mesh_correct_index], nan=0.0) >= self.mesh.correct_threshold)
        correct = correct.to(all_strategies.device) & (all_strategies >= 0)  # the bare group is no strategy cell
        metrics = {"rollouts/count": float(all_strategies.numel()),
                   "skipped/long_prompts": float(len(self.mesh_too_long))}  # dataset rows too long for the model
        if self.mesh.mu > 0:
            metrics |= self._balance_weights(out, inputs, correct, gather(out["query_ids"]), all_strategies, local)
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)
        return out

    # ---- balancing weights (once per generation batch, detached) -------------------------------------------
    def _seq_logps(self, model, prompt_ids, prompt_mask, out) -> torch.Tensor:
        """``[B]`` detached sum of completion-token log-probs under ``model`` (prompt tokens excluded)."""
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
        mask = completion_mask if "tool_mask" not in out else completion_mask * out["tool_mask"]
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
                completion_ids.size(1), batch_size=self.args.per_device_train_batch_size)
        return (logps * mask).sum(-1)

    def _completion_sums(self, per_token: torch.Tensor, out) -> torch.Tensor:
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        return (per_token * mask).sum(-1)

    def _reference_seq_logps(self, out) -> torch.Tensor:
        if "ref_per_token_logps" in out:
            return self._completion_sums(out["ref_per_token_logps"], out)
        if self._mesh_ref_model is not None:
            return self._seq_logps(self._mesh_ref_model, out["prompt_ids"], out["prompt_mask"], out)
        from trl.trainer.utils import use_adapter  # PEFT: the reference is the model with its adapter off

        unwrapped = self.accelerator.unwrap_model(self.model)
        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
            return self._seq_logps(self.model, out["prompt_ids"], out["prompt_mask"], out)

    def _balance_weights(self, out, inputs, correct, query_ids, strategy_ids, local) -> dict[str, float]:
        mesh = self.mesh
        if mesh.balance == "support":
            return self._support_weights(out, inputs, correct, query_ids, strategy_ids, local)
        if "old_per_token_logps" in out:
            seq = self._completion_sums(out["old_per_token_logps"], out)
        else:
            seq = self._seq_logps(self.model, out["prompt_ids"], out["prompt_mask"], out)
        ref = gather(self._reference_seq_logps(out)).double().cpu() if mesh.subtract_ref else None
        w, _, metrics = strategy_balance_row_weights(
            gather(seq).double().cpu(), ref, correct.cpu(), query_ids.cpu(), strategy_ids.cpu(), mesh.mu,
            subtract_ref=mesh.subtract_ref, reduction=mesh.reduction)
        out["mesh_balance_w"] = w[local].float().to(out["advantages"].device)
        return {k: v for k, v in metrics.items() if v == v}

    def _support_weights(self, out, inputs, correct, query_ids, strategy_ids, local) -> dict[str, float]:
        """meshrl's support balancing: weights from the completions' log-probs under the *bare* queries."""
        bare_ids, _, _ = self._tokenize_prompts([x["prompt"] for x in inputs])
        device = out["prompt_ids"].device
        width = max(len(ids) for ids in bare_ids)
        pad = self._tokenizer.pad_token_id
        ids = torch.full((len(bare_ids), width), pad, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(bare_ids):  # left padding, as TRL pads prompts
            ids[i, width - len(row):] = torch.tensor(row, device=device)
            mask[i, width - len(row):] = 1
        seq = self._seq_logps(self.model, ids, mask, out)
        w, metrics = support_balance_row_weights(gather(seq).double().cpu(), correct.cpu(), query_ids.cpu(),
                                                 strategy_ids.cpu(), self.mesh.mu, reduction=self.mesh.reduction)
        out["mesh_support_w"] = w[local].float().to(device)
        out["mesh_bare_prompt_ids"], out["mesh_bare_prompt_mask"] = ids, mask
        return {k: v for k, v in metrics.items() if v == v}

    # ---- loss ------------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                            *args, **kwargs)
        if self._mesh_capture is not None and torch.is_grad_enabled():
            self._mesh_capture.append(result[0])
        return result

    def _compute_loss(self, model, inputs):
        w = inputs.get("mesh_balance_w") if self.model.training else None
        self._mesh_capture = [] if w is not None else None
        try:
            loss = super()._compute_loss(model, inputs)
            captured = self._mesh_capture
        finally:
            self._mesh_capture = None
        if w is not None:
            if not captured:
                raise RuntimeError("MeshGRPOTrainer: TRL's loss computed no per-token log-probs to balance")
            loss = loss + self.balance_term(captured[0], inputs, w)
        if self.model.training and inputs.get("mesh_support_w") is not None:
            loss = loss + self._support_term(model, inputs)
        return loss

    def balance_term(self, per_token_logps: torch.Tensor, inputs, w: torch.Tensor) -> torch.Tensor:
        """``W * sum_j w_j seq_logp_j`` of one micro-batch: its gradient summed over a step's micro-batches and
        averaged over the W processes is ``grad J`` of :func:`meshrl.mesh.strategy_balance_loss`."""
        seq = self._completion_sums(per_token_logps, inputs)
        return self.accelerator.num_processes * (w.to(seq.dtype) * seq).sum()

    def _support_term(self, model, inputs) -> torch.Tensor:
        w = inputs["mesh_support_w"]
        rows = (w != 0).nonzero(as_tuple=True)[0]
        if rows.numel() == 0:
            return torch.zeros((), device=w.device)
        completion_ids, completion_mask = inputs["completion_ids"][rows], inputs["completion_mask"][rows]
        logps, _, _ = super()._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["mesh_bare_prompt_ids"][rows], completion_ids], 1),
            torch.cat([inputs["mesh_bare_prompt_mask"][rows], completion_mask], 1), completion_ids.size(1))
        if "tool_mask" in inputs:  # tool output inside a completion is the environment's, not the policy's
            completion_mask = completion_mask * inputs["tool_mask"][rows]
        seq = (logps * completion_mask).sum(-1)
        return self.accelerator.num_processes * (w[rows].to(seq.dtype) * seq).sum()
