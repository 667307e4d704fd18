"""Per-token log-probs and entropies from the policy's last hidden states, its output head applied in chunks.

The plain path (:func:`meshrl.trainer.batch.response_logits`, then :func:`~meshrl.trainer.batch.token_logprobs`
and :func:`~meshrl.trainer.batch.token_entropy`) holds the response logits ``[n, T, V]`` whole: in float32, plus
the log-softmax that autograd keeps for the backward, plus its gradient there, plus bf16 copies under autocast.
For SmolLM2-135M (V = 49,152) and 32 rollouts of 48 tokens each of those is 302 MB, and together they are the
largest term of the update's peak after the weights and AdamW's state (benchmarks/README.md, "Memory").

Here the forward runs with the head set aside (:func:`head_set_aside`), so that the same shared-prompt / packed /
one-pass layout yields the hidden states ``[n, T, H]`` (H = 576 for SmolLM2) where it yielded logits. Then, per
chunk of ``chunk`` tokens, the head's logits (under the same autocast), the tempered log-softmax, the sampled
token's log-prob and the entropy are computed exactly as the plain path computes them, row by row, so the values
are the plain path's up to the rounding of a matmul over fewer rows. With a graph, each chunk runs under
:func:`torch.utils.checkpoint.checkpoint`: it keeps only its input hidden states and recomputes its logits in the
backward (Chen et al. 2016, "Training deep nets with sublinear memory cost"), so at most one chunk's logits exist
at a time, at the cost of a second head matmul per token in the backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshrl.models.lora import base_model


def output_head(model: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """``(head module, its attribute name on the base model)``, or None when the model has no plain output head
    as a direct child (then the plain path is used)."""
    lm = base_model(model)
    get = getattr(lm, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    name = next((n for n, child in lm.named_children() if child is head), None)
    return None if name is None else (head, name)


@contextmanager
def head_set_aside(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model's output head replaced by the identity for the duration: its forward returns hidden states in
    place of logits. Yields the head. Its parameters (tied or not) stay what they are."""
    found = output_head(model)
    if found is None:
        raise ValueError(f"{type(base_model(model)).__name__} has no output head to set aside")
    head, name = found
    lm = base_model(model)
    setattr(lm, name, torch.nn.Identity())
    try:
        yield head
    finally:
        setattr(lm, name, head)


def _chunk_terms(hidden: torch.Tensor, tokens: torch.Tensor, head: torch.nn.Module, autocast_bf16: bool,
                 temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log-prob of each token, entropy or None)`` of ``softmax(head(hidden) / temperature)`` for ``[k, H]``
    hidden states; the same operations as token_logprobs and token_entropy on the full logits."""
    ctx = torch.autocast(hidden.device.type, dtype=torch.bfloat16) if autocast_bf16 else nullcontext()
    with ctx:
        # The caller's response_logits made the hidden states float32; bf16 weights read them back losslessly.
        logits = head(hidden.to(next(head.parameters()).dtype))
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, tokens[:, None]).squeeze(-1)
    if not entropy:
        return picked, None
    with torch.no_grad():
        return picked, -(logp.exp() * logp).sum(-1)


def chunked_token_terms(hidden: torch.Tensor, tokens: torch.Tensor, head: torch.nn.Module, *, chunk: int,
                        autocast_bf16: bool, temperature: float = 1.0,
                        entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``[n, T]`` (with a graph when grad is enabled) and, with ``entropy``, entropies
    ``[n, T]`` (detached) of ``tokens`` from hidden states ``[n, T, H]``, ``chunk`` tokens at a time (module
    docstring)."""
    if chunk < 1:
        raise ValueError(f"train.head_chunk must be >= 1 to chunk the head, got {chunk}")
    n, t = tokens.shape
    flat_h = hidden.reshape(n * t, hidden.shape[-1])
    flat_y = tokens.reshape(n * t).to(hidden.device)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    logps, entropies = [], []
    for a in range(0, n * t, chunk):
        args = (flat_h[a : a + chunk], flat_y[a : a + chunk], head, autocast_bf16, temperature, entropy)
        lp, ent = checkpoint(_chunk_terms, *args, use_reentrant=False) if grad else _chunk_terms(*args)
        logps.append(lp)
        entropies.append(ent)
    ent_all = torch.cat(entropies).view(n, t) if entropy else None
    return torch.cat(logps).view(n, t), ent_all
