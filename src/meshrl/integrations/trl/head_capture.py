"""The LM head's input, read from TRL's own forward: what the ``bias`` MEI features need, with no second forward.

TRL 1.16's ``add_fused_lm_head`` replaces the causal LM's forward with: backbone -> ``last_hidden_state[:, :-1]``
-> a tiled log-softmax through ``get_output_embeddings().weight``, ``(h W^T + b) / T``. The head module itself is
never called (a hook on it would not fire) and no logits are kept, so :class:`HiddenCapture` hooks the backbone:
its output is exactly the LM head's input. Of a ``prompt + completion`` sequence of length ``L`` with ``C``
completion tokens, positions ``[L - C - 1, L - 1)`` are those whose logits score the completion tokens (the
alignment of ``logits_to_keep=C + 1`` then ``[:, :-1]``). Only those ``B x C x D`` hidden states are kept; the
features are then ``phi_i = sum_t m_t (e_{y_t} - softmax(h_t W^T + b) / T)`` (``bias_features_from_hidden``),
which costs one LM-head projection of the completion tokens instead of a whole forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate.utils import is_peft_model

from meshrl.diagnostics import bias_features_from_hidden

# Config fields with which TRL's fused head rescales or soft-caps the logits; models that set one are left to the
# extra forward (the model's own logits), rather than re-deriving TRL's transform here.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")


class HeadUnsupported(ValueError):
    """The trainer's model or set-up does not let the LM head's input be read from its forward."""


class Recording:
    """Hidden states of the completion positions from the backbone forwards of one window, in call order.

    The first forwards covering ``rows`` rows are recorded; later ones in the same window (another forward of
    the same trainer call, such as ``MeshGRPOTrainer``'s bare-prompt support term) are not this batch's.
    """

    def __init__(self, rows: int, length: int, width: int) -> None:
        self.rows, self.length, self.width = rows, length, width
        self.chunks: list[torch.Tensor] = []
        self.seen = 0
        self.error: str | None = None

    def hook(self, module, args, output) -> None:
        if self.seen >= self.rows:
            return
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None and isinstance(output, tuple | list) and output:
            hidden = output[0]
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.size(1) != self.length:
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            self.error = f"the backbone returned hidden states {shape}, expected [*, {self.length}, D]"
            self.seen = self.rows
            return
        start = self.length - self.width - 1
        self.chunks.append(hidden[:, start:start + self.width].detach().clone())
        self.seen += hidden.size(0)

    def hidden(self) -> torch.Tensor | None:
        """``[rows, width, D]``, or ``None`` when the window's forwards did not cover the rows as expected."""
        if self.error is not None or self.seen != self.rows:
            return None
        return torch.cat(self.chunks)


def unsupported_reason(trainer) -> str | None:
    """Why the LM head's input cannot be read from ``trainer``'s forward, or ``None`` when it can."""
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        return "DeepSpeed / FSDP shard the LM head's weight outside the forward"
    if getattr(trainer, "_is_vlm", False):
        return "vision-language models are not hooked"
    model = _causal_lm(trainer.accelerator.unwrap_model(trainer.model))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return f"{type(model).__name__} has no output embedding with a weight"
    if getattr(model, "base_model", model) is model:
        return f"{type(model).__name__} has no separate backbone to hook"
    config = model.config.get_text_config()
    scaled = [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) is not None]
    if scaled:
        return f"{type(model).__name__} transforms its logits ({', '.join(scaled)})"
    return None


def _causal_lm(model):
    return model.get_base_model() if is_peft_model(model) else model


class HiddenCapture:
    """Records the LM head's input during a trainer's own forwards; ``HeadUnsupported`` where it cannot."""

    def __init__(self, trainer) -> None:
        reason = unsupported_reason(trainer)
        if reason is not None:
            raise HeadUnsupported(reason)
        self.trainer = trainer

    def _parts(self):
        # Looked up on each use, as TRL does: PEFT and accelerate may replace modules after the callback attaches.
        model = _causal_lm(self.trainer.accelerator.unwrap_model(self.trainer.model))
        return model.base_model, model.get_output_embeddings()

    @contextmanager
    def recording(self, rows: int, length: int, width: int) -> Iterator[Recording]:
        """Record the completion positions of the next backbone forwards over ``rows`` rows of length ``length``."""
        record = Recording(rows, length, width)
        handle = self._parts()[0].register_forward_hook(record.hook)
        try:
            yield record
        finally:
            handle.remove()

    def features(self, hidden: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                 temperature: float) -> torch.Tensor:
        """``[B, V]`` float32 bias features of recorded hidden states (see the module docstring)."""
        head = self._parts()[1]
        return bias_features_from_hidden(hidden, head.weight, tokens, mask, temperature, bias=head.bias).float()

    def is_policy(self, model) -> bool:
        unwrap = self.trainer.accelerator.unwrap_model
        return unwrap(model) is unwrap(self.trainer.model)
