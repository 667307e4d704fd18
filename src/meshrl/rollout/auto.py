"""``rollout.backend=auto``: which sampler a run gets, ``vllm``, ``native`` or ``hf``, by the measured rule of
:mod:`meshrl.rollout.choice` and what the model supports; registered as the backend ``auto``."""

from __future__ import annotations

import logging
from typing import Any

from meshrl.rollout.base import RolloutBackend, register_backend
from meshrl.rollout.choice import StepShape, choose_sampler, log_once, vllm_installed
from meshrl.rollout.hf import HFGenerateBackend, in_process_settings
from meshrl.rollout.native import NativeDecodeBackend, native_settings, probe_prompts, unsupported_reason

log = logging.getLogger("meshrl")


def auto_backend(model, tokenizer, *, shape: StepShape | None = None, batch_size: int | None = None,
                 workers: int | None = None, prepack: bool = True, decoder: str = "auto",
                 **kwargs: Any) -> RolloutBackend:
    """``rollout.backend=auto``: ``vllm`` where :func:`meshrl.rollout.choice.choose_sampler` picks it for the
    policy's device and the step's ``shape`` (sequences x new tokens) and vLLM is installed (its build failing,
    e.g. a head size vLLM's CPU build lacks, falls through to native with a warning); else ``native`` when it can
    run ``model`` and agrees with the model's own forward on :func:`probe_prompts`; otherwise ``hf``
    (transformers ``generate``). The choice and its reason are logged."""
    device = next(model.parameters()).device.type
    available = vllm_installed()
    choice, why = choose_sampler(device=device, vllm_available=available, shape=shape)
    if choice == "vllm":
        from meshrl.rollout.vllm_backend import VLLMBackend

        try:
            backend = VLLMBackend(model, tokenizer)  # its own precision and batching: kwargs are the in-process ones
        except (ImportError, ValueError) as err:
            log.warning("rollout backend auto: %s, but vllm failed to start (%s); trying native", why, err)
        else:
            log_once("rollout backend auto -> vllm: %s", why)
            return backend
    elif available:
        log_once("rollout backend auto -> native: %s", why)
    reason = unsupported_reason(model)
    if reason is None:
        native = NativeDecodeBackend(model, tokenizer, batch_size=batch_size, workers=workers, prepack=prepack,
                                     decoder=decoder, **kwargs)
        try:
            native.verify(probe_prompts(tokenizer))
            return native
        except RuntimeError as err:
            reason = str(err)
            log.warning("rollout backend auto -> hf: %s", reason)
    else:
        log.info("rollout backend auto -> hf (native: %s)", reason)
    return HFGenerateBackend(model, tokenizer, batch_size=batch_size, **kwargs)


class _Auto:
    """The registry's ``auto`` entry: called like a backend class, it returns the backend it chooses."""

    name = "auto"

    def __call__(self, model, tokenizer, **kwargs: Any) -> RolloutBackend:
        return auto_backend(model, tokenizer, **kwargs)

    def from_config(self, rollout: Any, model, tokenizer, *, shape: StepShape | None = None,
                    **context: Any) -> RolloutBackend:
        return auto_backend(model, tokenizer, shape=shape, **in_process_settings(rollout), **native_settings(rollout))


register_backend("auto")(_Auto())
