"""The policy's forward passes for the update: micro-batches, response logits, per-row log-probs.

One object holds what every forward of a run shares (the model, the frozen reference, autocast, the speed path, the
micro-batch size, the sampling temperature), so that the step, the plug-ins and the Mesh balancing term
all score rollouts the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from meshrl.rollout.truncation import truncated_logprobs
from meshrl.trainer.batch import MicroBatch, collate, token_entropy, token_logprobs
from meshrl.trainer.speed import SpeedPath, make_speed_path


class PolicyForward:
    def __init__(self, cfg: Any, model: torch.nn.Module, ref_model: torch.nn.Module | None, pad_id: int,
                 bare_prompt: Callable[[Any], list[int]], speed: SpeedPath | None = None) -> None:
        self.model, self.ref_model, self.pad_id = model, ref_model, pad_id
        self.temperature = cfg.rollout.temperature
        self.micro_batch_size = cfg.train.micro_batch_size
        self._train = cfg.train
        self._bare_prompt = bare_prompt  # problem -> its prompt ids without a coach prefix
        # How the forwards are made cheaper (prompt sharing, the chunked head, lean activations...): the run's
        # speed path, chosen once (meshrl.trainer.speed); this module names none of them.
        self.speed = speed if speed is not None else make_speed_path(cfg.train)

    def logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """Response logits ``[n, T, V]`` of ``model`` with the configured autocast, in the speed path's layout."""
        # Autocast's weight cache stays on: with it the prompt and response passes share one bf16 copy of a weight,
        # whose gradient autograd then sums in bf16; casting at each use would sum it in float32, a (small) change.
        return self.speed.forward_logits(model, mb, self._train.autocast_bf16)

    def chunks_head(self, model: torch.nn.Module) -> bool:
        """Whether :meth:`token_terms` computes ``model``'s head in chunks (the speed path's ``head_chunk`` > 0 and
        a head that can be set aside), instead of from the whole logits."""
        return self.speed.chunks_head(model)

    def token_terms(self, model: torch.nn.Module, mb: MicroBatch,
                    entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs ``[n, T]`` (with a graph when grad is enabled) and, with ``entropy``, detached
        entropies ``[n, T]`` of the responses under ``model``: from chunks of the head (never the whole logits)
        when :meth:`chunks_head`, else from :meth:`logits`. Equal up to float rounding at every response token; the
        chunked head skips the right padding (0 there), which every reader masks."""
        if not self.chunks_head(model):
            logits = self.logits(model, mb)
            logp = token_logprobs(logits, mb.response_ids, self.temperature)
            return logp, token_entropy(logits.detach(), self.temperature) if entropy else None
        return self.speed.chunked_token_terms(model, mb, lambda m: self.logits(m, mb), entropy=entropy,
                                              autocast_bf16=self._train.autocast_bf16, temperature=self.temperature)

    def micro_batches(self, rows: list[int], data: Any, *, bare: bool = False) -> Iterator[tuple[list[int],
                                                                                                MicroBatch]]:
        """``(row indices, MicroBatch)`` of ``rows``; ``bare`` puts each response after its query *without*
        the coach prefix it was sampled under (support balancing scores the unconditioned policy)."""
        size = self.micro_batch_size
        for i in range(0, len(rows), size):
            idx = rows[i : i + size]
            prompts = ([self._bare_prompt(data.problems[j]) for j in idx] if bare
                       else [data.prompt_ids[j] for j in idx])
            masks = [data.model_mask(j) for j in idx] if getattr(data, "response_masks", None) else None
            yield idx, collate(prompts, [data.response_ids[j] for j in idx], self.pad_id, masks).to(self.device)

    def collate(self, prompts: list[list[int]], responses: list[list[int]]) -> MicroBatch:
        return collate(prompts, responses, self.pad_id).to(self.device)

    @property
    def device(self) -> torch.device:
        """Where the policy lives (``train.device``): every micro-batch is placed there."""
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")  # a parameter-free stand-in: the host

    @torch.no_grad()
    def logps(self, model: torch.nn.Module, data: Any) -> list[torch.Tensor]:
        """Per-row log-probs ``[T_i]`` of each response under ``model`` (old policy or reference)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(data)
        for idx, mb in self.micro_batches(list(range(len(data))), data):
            lp, _ = self.token_terms(model, mb, entropy=False)
            for k, j in enumerate(idx):
                out[j] = lp[k, : len(data.response_ids[j])].cpu()
        return out

    @torch.no_grad()
    def log_kept_mass(self, model: torch.nn.Module, data: Any, top_p: float) -> list[torch.Tensor]:
        """Per row ``[T_i]``: log of the tempered probability mass the sampler's top-p set keeps at each response
        token under ``model`` (vLLM's rule, :func:`meshrl.rollout.truncation.kept_mask`); 0 where nothing is cut."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(data)
        temperature = self.temperature if self.temperature > 0 else 1.0
        for idx, mb in self.micro_batches(list(range(len(data))), data):
            _, kept = truncated_logprobs(self.logits(model, mb), mb.response_ids, temperature=temperature,
                                         top_p=top_p)
            for k, j in enumerate(idx):
                out[j] = kept[k, : len(data.response_ids[j])].cpu()
        return out

    def ref_logps(self, data: Any) -> list[torch.Tensor]:
        """Per-row log-probs under the frozen reference (a copy, or the base model with the LoRA adapter off)."""
        if self.ref_model is not None:
            return self.logps(self.ref_model, data)
        from meshrl.models import reference_mode

        with reference_mode(self.model):
            return self.logps(self.model, data)

    def reference_logits(self, mb: MicroBatch) -> torch.Tensor:
        if self.ref_model is not None:
            return self.logits(self.ref_model, mb)
        from meshrl.models import reference_mode

        with reference_mode(self.model):
            return self.logits(self.model, mb)

    @torch.no_grad()
    def response_terms(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies ``[n, T]`` of a micro-batch under the policy, without a graph."""
        logp, entropy = self.token_terms(self.model, mb)
        assert entropy is not None
        return logp, entropy

    def seq_logp(self, mb: MicroBatch) -> torch.Tensor:
        """Per-row sum of response log-probs under the policy, with a graph."""
        logp, _ = self.token_terms(self.model, mb, entropy=False)
        return (logp * mb.response_mask).sum(-1)
