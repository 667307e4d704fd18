"""Rollouts with transformers ``generate``: CPU or GPU, any causal LM (peft models included)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig

from meshrl.rollout.base import (
    RolloutBackend,
    Rollouts,
    SamplingParams,
    cut_at_eos,
    eos_ids,
    register_backend,
)

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16}


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` with prompts right-aligned, so every row's next token is at -1."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids) :] = 1
    return input_ids.to(device), mask.to(device)


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """Eval mode (no dropout) for sampling, then back to whatever mode the trainer had."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch for one ``generate`` call without disturbing the caller's RNG streams."""
    devices = [device.index if device.index is not None else 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def generation_config(params: SamplingParams, eos: list[int], pad_id: int) -> GenerationConfig:
    """A config that samples from softmax(logits / T), top-p (and top-k only when asked), with the KV cache.

    Everything a checkpoint's generation_config.json could set to reshape the distribution (top_k=50
    is transformers' default, repetition penalties, ...) is pinned to neutral, so that samples follow
    the policy whose log-probs the trainer computes.
    """
    kw: dict = dict(
        max_new_tokens=params.max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad_id,
        use_cache=True,
        num_beams=1,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        # ignore_eos: eos masked until the end (generate stops every row at an eos it samples)
        **({"min_new_tokens": params.max_new_tokens} if params.ignore_eos else {"min_length": 0}),
    )
    if params.greedy:
        kw["do_sample"] = False
    else:
        kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                  typical_p=1.0)
    return GenerationConfig(**kw)


def in_process_settings(rollout: Any) -> dict[str, Any]:
    """The keywords every in-process sampler takes from a run's rollout settings."""
    return {"batch_size": rollout.batch_size, "autocast": "bfloat16" if rollout.autocast_bf16 else None}


class InProcessBackend(RolloutBackend):
    """What the backends that run the policy module in this process share: argument checks, eos and pad
    ids, the device, autocast, prompt-major jobs and the assembly of :class:`Rollouts`.

    ``batch_size`` bounds how many sequences (prompt copies, counting each of the ``n`` samples) go
    through one batch; None means all at once. ``autocast`` ("bfloat16") runs the forward passes under
    ``torch.autocast``. The backend holds a reference to the policy, so ``sync_weights`` with the same
    model is a no-op.
    """

    returns_features = True  # both in-process samplers hold the whole tempered distribution of every step

    def __init__(self, model, tokenizer, *, batch_size: int | None = None, autocast: str | None = None):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        if autocast is not None and autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be one of {sorted(AUTOCAST_DTYPES)} or None, got {autocast!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.autocast = autocast
        self.eos = eos_ids(model, tokenizer)
        # Left padding is masked out, so any id works; prefer the declared pad, else eos.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]

    @classmethod
    def from_config(cls, rollout: Any, model, tokenizer, **context: Any) -> InProcessBackend:
        return cls(model, tokenizer, **in_process_settings(rollout))

    def sync_weights(self, model) -> None:
        self.model = model

    def precision(self, weights: str) -> str:
        return f"autocast-{self.autocast}" if self.autocast else weights

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[self.autocast])

    @staticmethod
    def _jobs(prompt_ids: list[list[int]], n: int) -> list[tuple[int, list[int]]]:
        """``(prompt index, prompt)`` repeated ``n`` times each, prompt-major (so that batches can split
        the copies of one prompt when n is large)."""
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        return [(i, list(p)) for i, p in enumerate(prompt_ids) for _ in range(n)]

    def _append(self, result: Rollouts, jobs: list[tuple[int, list[int]]], rows: list[list[int]],
                logps: list[list[float]] | None = None, features: np.ndarray | None = None, *,
                ignore_eos: bool = False) -> None:
        """Add raw generated rows (which may run past eos) to ``result``, cut at the first eos (whole rows with
        ``ignore_eos``), with the sampler's log-probs of the kept tokens when ``logps`` (one list per row, aligned
        with ``rows``) is given, and each row's MEI features when ``features`` (``[rows, V]``, already summed over
        the kept tokens) is."""
        for k, ((index, prompt), tokens) in enumerate(zip(jobs, rows, strict=True)):
            response, truncated = (list(tokens), True) if ignore_eos else cut_at_eos(tokens, self.eos)
            result.prompt_index.append(index)
            result.prompt_ids.append(prompt)
            result.response_ids.append(response)
            result.truncated.append(truncated)
            if result.engine_logprobs is not None and logps is not None:
                result.engine_logprobs.append([float(x) for x in logps[k][: len(response)]])
            if result.engine_features is not None and features is not None:
                result.engine_features.append(features[k])

    def _finish(self, result: Rollouts) -> Rollouts:
        result.texts = self.tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
        return result


@register_backend("hf")
class HFGenerateBackend(InProcessBackend):
    """Batched ``model.generate`` with left padding (see :class:`InProcessBackend` for the arguments)."""

    name = "hf"

    def _generate_batch(self, prompts: list[list[int]], config: GenerationConfig, temperature: float,
                        features: bool = False) -> tuple[list[list[int]], list[list[float]], np.ndarray | None]:
        """Raw generated tokens per row (may run past eos: padding, or eos repeated when pad == eos), their
        log-probs ``log softmax(logits / T)[y]`` from the step's raw logits (``output_logits``; ``T = 1`` when
        greedy): the tempered distribution before the top-p cut, as the trainer scores it and as
        :func:`meshrl.rollout.native.sample_with_logprobs` returns it (``output_scores`` would be the processed
        scores, with the top-p tail at -inf), and with ``features`` each row's MEI ``bias`` features
        ``sum_t (e_{y_t} - softmax(z_t / T))`` over its tokens up to and including its first eos (``[rows, V]``
        float32; :func:`meshrl.diagnostics.bias_features`)."""
        input_ids, mask = left_pad(prompts, self.pad_id, self.device)
        with self._autocast():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        tokens = out.sequences[:, input_ids.shape[1] :]
        t = temperature if temperature > 0 else 1.0
        eos = torch.tensor(self.eos, device=tokens.device)
        running = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)  # no eos before this step
        phi = None
        # One step at a time: only the sampled token's log-prob is kept, never a [n, steps, V] copy.
        steps = []
        for i, step in enumerate(out.logits[: tokens.shape[1]]):
            logp_all = torch.log_softmax(step.float() / t, dim=-1)
            steps.append(logp_all.gather(-1, tokens[:, i : i + 1])[:, 0])
            if features:
                phi = torch.zeros_like(logp_all) if phi is None else phi
                phi -= torch.where(running[:, None], logp_all.exp(), 0.0)
                phi.scatter_add_(1, tokens[:, i : i + 1], running[:, None].float())
                running &= ~torch.isin(tokens[:, i], eos)
        logps = torch.stack(steps, dim=1) if steps else torch.zeros(tokens.shape, dtype=torch.float32)
        return tokens.tolist(), logps.tolist(), None if phi is None else phi.cpu().numpy()

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, seed: int,
                 features: bool = False) -> Rollouts:
        jobs = self._jobs(prompt_ids, params.n)
        step = self.batch_size or max(len(jobs), 1)
        config = generation_config(params, self.eos, self.pad_id)
        config.return_dict_in_generate, config.output_logits = True, True  # the sampler's log-probs (raw logits)
        result = Rollouts(engine_logprobs=[], engine_features=[] if features else None)
        with eval_mode(self.model), torch.inference_mode(), seeded(seed, self.device):
            for start in range(0, len(jobs), step):
                chunk = jobs[start : start + step]
                rows, logps, phi = self._generate_batch([p for _, p in chunk], config, params.temperature, features)
                self._append(result, chunk, rows, logps, phi, ignore_eos=params.ignore_eos)
        return self._finish(result)
