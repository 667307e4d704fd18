"""LoRA adapters through peft, and the reference policy as "the same model with the adapter off".

With LoRA the frozen base weights are the reference policy, so no second copy of the model is needed:
``with reference_mode(model): ref_logits = model(...)`` computes reference log-probs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from meshrl.errors import MissingDependency


def apply_lora(
    model,
    r: int = 8,
    alpha: int = 16,
    target_modules: list[str] | str | None = None,
    dropout: float = 0.0,
):
    """Wrap ``model`` in a peft ``PeftModel`` with a LoRA adapter; only adapter weights train.

    ``target_modules=None`` adapts every linear layer except the output head ("all-linear"). The LoRA
    B matrices start at zero, so the wrapped model initially computes exactly the base model.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # optional extra
        raise MissingDependency("LoRA needs peft: pip install 'meshrl[peft]'") from exc
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules if target_modules is not None else "all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def base_model(model):
    """The ``*ForCausalLM`` module under a peft wrapper (its Linear layers carry the adapters), else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def has_lora(model) -> bool:
    """True when ``model`` is a peft model whose adapter ``reference_mode`` can switch off."""
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


@contextmanager
def reference_mode(model) -> Iterator[None]:
    """Inside the block, ``model`` computes the base (reference) policy: its LoRA adapter is off.

    Raises TypeError for a model without an adapter: silently running the policy itself as the
    reference would make every KL term zero. Use a frozen copy of the model in that case.
    """
    if not has_lora(model):
        raise TypeError("reference_mode needs a LoRA (peft) model; keep a frozen reference copy instead")
    with model.disable_adapter():
        yield


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """Weights of the policy as a plain (non-peft) state dict, LoRA deltas added to the base weights.

    Used to push the current policy into an engine (vLLM) that knows nothing about adapters. The deltas
    are added out of place rather than with peft's merge/unmerge, whose float round trip would slowly
    drift the frozen base weights, i.e. the reference policy. The model itself is left unchanged.
    """
    state = {k: v.detach() for k, v in model.state_dict().items() if "lora_" not in k}
    if not has_lora(model):
        return state
    from peft.tuners.lora import LoraLayer

    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or module.merged:
            continue
        key = f"{module_name}.base_layer.weight"
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                state[key] = state[key] + module.get_delta_weight(adapter).to(state[key].dtype)
    # peft keys look like base_model.model.<hf key>, with ".base_layer" inside adapted layers.
    return {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v for k, v in state.items()}
