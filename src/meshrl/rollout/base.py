"""Rollout contract: sampling parameters, the per-sample result record, the backend interface, registry."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("meshrl")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``temperature == 0`` means greedy; ``n`` samples per prompt; ``top_k`` > 0 keeps only the
    ``top_k`` most likely tokens before the top-p cut (vLLM's rule, :func:`meshrl.rollout.truncation.kept_mask`;
    0: off, as every rollout of the trainer samples). ``ignore_eos``: eos does not end a response, every response
    is ``max_new_tokens`` long (vLLM's ``ignore_eos``; for throughput measurements, where every backend must do
    the same work; ``hf`` suppresses eos instead, ``min_new_tokens``, which costs the same)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    top_k: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Rollouts:
    """One entry per sample, prompt-major: the ``n`` samples of prompt 0, then those of prompt 1, ...

    ``response_ids`` runs up to and including the first eos (nothing after it); ``truncated`` is True
    when no eos came within ``max_new_tokens``. ``texts`` are the responses decoded without special
    tokens. ``engine_logprobs`` holds the sampler's own log-prob of each response token, as the rollout
    engine computed it (its precision, its kernels), one list per sample aligned with ``response_ids``; None
    when a backend cannot return them. The distribution is ``log softmax(logits / T)[y_t]`` over the whole
    vocabulary (``T = 1`` for greedy), *before* any top-p cut: the one the trainer's update scores
    (``meshrl.trainer.batch.token_logprobs``), so that the two can be compared token for token (the mismatch
    diagnostic and ``plugins.rollout_corr``, docs/plugins.md). ``native`` and ``hf`` return exactly this;
    ``vllm`` returns what its ``logprobs_mode`` says (see :mod:`meshrl.rollout.vllm_backend`).

    ``engine_features`` (only when ``generate(..., features=True)`` asked a backend that
    :attr:`RolloutBackend.returns_features`; else None): per sample, the ``bias`` feature map of MEI,
    ``phi = sum_t (e_{y_t} - softmax(z_t / T))`` over its response tokens (float32 numpy ``[V]``, ``T = 1`` for
    greedy; :func:`meshrl.diagnostics.bias_features`), summed by the sampler from the distributions it drew
    from, so that the trainer need not recompute them from its update's logits.
    """

    prompt_index: list[int] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    engine_logprobs: list[list[float]] | None = None
    engine_features: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)


class RolloutBackend(ABC):
    """Generates samples from the current policy. One ``generate`` call per training step.

    The whole contract the trainer relies on is declared here, with defaults a backend overrides as needed:
    :meth:`generate` and :meth:`sync_weights` (abstract), :meth:`from_config` (how a run builds it),
    :attr:`model` (the policy an in-process sampler reads, for its context length; None out of process),
    :attr:`logprobs_truncated`, :attr:`returns_features`, :meth:`precision` (for the mismatch diagnostic),
    :meth:`release_workers` and :meth:`close`. A new backend is one registered class (:func:`register_backend`)
    and its test."""

    name: str = "base"
    # True when the log-probs a backend returns are taken under the truncated (top-p / top-k) distribution it
    # sampled from; False when they are over the whole tempered vocabulary (the in-process samplers).
    logprobs_truncated: bool = False
    # True when ``generate(..., features=True)`` fills ``Rollouts.engine_features`` (the in-process samplers).
    returns_features: bool = False
    # The policy module an in-process sampler reads (None: the sampler holds its own copy, e.g. vLLM's engine).
    model: Any = None

    @classmethod
    def from_config(cls, rollout: Any, model, tokenizer, **context: Any) -> RolloutBackend:
        """The backend for a run's ``rollout`` settings (:class:`meshrl.trainer.config.RolloutConfig`); ``context``
        carries what the run knows besides (``shape``: the step's :class:`meshrl.rollout.choice.StepShape`).
        Default: the class on the policy alone."""
        return cls(model, tokenizer)

    def precision(self, weights: str) -> str:
        """The precision the sampler computes in, for the mismatch diagnostic's record (``weights``: the policy's
        weight dtype, what an in-process sampler without autocast computes in)."""
        return weights

    def release_workers(self) -> None:
        """Free what the sampler holds between steps that the update does not need (worker processes, caches);
        the next :meth:`generate` rebuilds it. Default: nothing to free."""
        return None

    def close(self) -> None:
        """Stop what the backend started (processes, engines). Default: nothing."""
        return None

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, seed: int,
                 features: bool = False) -> Rollouts:
        """Sample ``params.n`` responses for each prompt; the same seed gives the same samples. ``features``:
        also return each sample's MEI features (``Rollouts.engine_features``) when :attr:`returns_features`;
        the samples do not depend on it."""

    @abstractmethod
    def sync_weights(self, model) -> None:
        """Make the backend sample from ``model``'s current weights (call after each optimiser step)."""


BACKENDS: dict[str, Any] = {}  # name -> backend class (or, for ``auto``, a chooser with ``from_config``)


def register_backend(name: str) -> Callable:
    """Decorator: make a backend class available to ``make_backend(name, ...)``."""

    def deco(cls: Callable[..., RolloutBackend]) -> Callable[..., RolloutBackend]:
        BACKENDS[name] = cls
        return cls

    return deco


def make_backend(name: str, model, tokenizer, **kwargs) -> RolloutBackend:
    """Construct the backend registered as ``name`` (``auto``, ``hf``, ``native``, ``vllm``; :data:`BACKENDS`)
    for ``model``/``tokenizer``; ``auto`` chooses among the others (:mod:`meshrl.rollout.auto`)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](model, tokenizer, **kwargs)


def backend_for_run(rollout: Any, model, tokenizer, **context: Any) -> RolloutBackend:
    """The backend ``rollout.backend`` names, built from the run's settings (:meth:`RolloutBackend.from_config`)."""
    if rollout.backend not in BACKENDS:
        raise ValueError(f"rollout.backend: unknown {rollout.backend!r}; known: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[rollout.backend].from_config(rollout, model, tokenizer, **context)


def eos_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a response: the tokenizer's eos plus the model's generation eos ids.

    Chat checkpoints often list several (e.g. Qwen's <|im_end|> and <|endoftext|>).
    """
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    candidates: Iterable = ()
    if gen is not None and gen.eos_token_id is not None:
        candidates = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    for tok_id in [tokenizer.eos_token_id, *candidates]:
        if tok_id is not None and tok_id not in ids:
            ids.append(int(tok_id))
    if not ids:
        raise ValueError("the tokenizer/model define no eos token; rollouts could never end")
    return ids


def cut_at_eos(tokens: Sequence[int], eos: Sequence[int]) -> tuple[list[int], bool]:
    """``(tokens up to and including the first eos, truncated)``; truncated when there is no eos.

    Everything after the first eos is padding or garbage; this matters when pad == eos (SmolLM2), where
    a finished row is padded with more eos tokens that must not count as response.
    """
    stop = set(eos)
    for i, tok in enumerate(tokens):
        if tok in stop:
            return list(tokens[: i + 1]), False
    return list(tokens), True
