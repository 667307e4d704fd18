"""Rollout backends: ``hf`` (transformers ``generate``, CPU/GPU), ``native`` (meshrl's decode loop for
Llama-family models, CPU/GPU; ``auto`` picks it when it can) and ``vllm`` (optional, GPU).

``make_backend(name, model, tokenizer, **kw).generate(prompt_ids, SamplingParams(...), seed=...)``
returns ``Rollouts`` (prompt-major, ``n`` samples per prompt); call ``sync_weights(model)`` after
each optimiser step.
"""

from meshrl.rollout.auto import auto_backend  # noqa: I001  (registers "auto" once the others are registered)
from meshrl.rollout.base import (
    BACKENDS,
    RolloutBackend,
    Rollouts,
    SamplingParams,
    backend_for_run,
    cut_at_eos,
    eos_ids,
    make_backend,
    register_backend,
)
from meshrl.rollout.hf import HFGenerateBackend, left_pad
from meshrl.rollout.native import NativeDecodeBackend, unsupported_reason
from meshrl.rollout.vllm_backend import VLLMBackend, save_policy

__all__ = [
    "BACKENDS",
    "HFGenerateBackend",
    "NativeDecodeBackend",
    "RolloutBackend",
    "auto_backend",
    "backend_for_run",
    "Rollouts",
    "SamplingParams",
    "VLLMBackend",
    "cut_at_eos",
    "eos_ids",
    "left_pad",
    "make_backend",
    "register_backend",
    "save_policy",
    "unsupported_reason",
]
