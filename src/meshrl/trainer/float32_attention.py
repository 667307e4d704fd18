"""The update's attention in float32 under bf16 autocast on a CPU: faster there, and closer to the exact value.

Autocast runs ``scaled_dot_product_attention`` in bf16, where PyTorch picks its flash-attention kernel. On a CPU
that kernel's bf16 backward is slow for the update's short sequences: for SmolLM2-135M's layer (9 heads of 64, 23
rows of 47 response tokens over 81 positions) forward + backward took 22.0 ms in bf16 flash attention and 11.8 ms
with the float32 math kernel on 2 threads (``benchmarks/JOURNAL.md``, "Step rate"). Thirty such layers were 12% of
an update of the step-rate protocol.

Inside :func:`float32_attention`, every layer that dispatches through transformers' ``sdpa`` attention function
(Llama, Qwen2/3, Mistral, ... all look it up in ``ALL_ATTENTION_FUNCTIONS`` at each forward) runs its attention in
float32 with autocast off and hands back its output in autocast's dtype, as the bf16 kernel did. Only forwards that
build a graph on a CPU under autocast, with scores of at most :data:`MAX_SCORE_BYTES` per layer, change; anything
else calls the plain function.

The attention itself is :class:`_Float32Attention`, not PyTorch's float32 math kernel, for memory: the math kernel
keeps float32 copies of the query, of keys and values repeated for every query head (grouped-query attention), and
the softmax, per layer, which raised the update's peak by 0.3-0.4 GB at the step-rate protocol (more than the bf16
flash kernel keeps). ``_Float32Attention`` multiplies each key/value head's stacked query heads by its keys
directly (no repeated copies) and keeps the inputs as given plus the float32 softmax, with the backward written
out; it was also 7% faster over a whole update than the math kernel (``benchmarks/JOURNAL.md``, "Memory back under
0.5x"). Calls it does not reproduce (an additive mask, dropout, keys longer than queries without a mask, other
keywords) take the math kernel. The result differs from the bf16 path by bf16 rounding and is no further from a
float32 model's (query and key leave the rotary embedding in float32 and are no longer rounded to bf16 before their
product; the projections' bf16 matmuls, unchanged, make most of the distance either way: 2-4% closer log-probs on
small Llama and Qwen2 models, ``tests/integration/test_float32_attention.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA = "sdpa"
# keywords of transformers' sdpa attention call that :func:`_grouped_attention` reproduces (others: the plain call)
PLAIN_KWARGS = frozenset({"dropout", "scaling", "is_causal", "position_ids", "use_cache", "cache_position"})


# The largest float32 score matrix [batch, heads, queries, keys] per layer run this way (30 layers of SmolLM2-135M
# at the step-rate protocol: 3.3 MB each); the math kernel makes a few of them, one layer at a time. Larger ones
# take the plain path, where attention is a smaller share of the work and flash attention's tiling pays.
MAX_SCORE_BYTES = 8 << 20


class _Float32Attention(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) v`` in float32, heads grouped over shared keys and values (GQA) without
    copying them, keeping for the backward only the inputs as given and the softmax ``p`` (float32).

    ``q`` is ``[b, kv_heads, group * T, d]`` (a key/value head's query heads stacked), ``k`` and ``v`` are
    ``[b, kv_heads, S, d]``, ``allowed`` a bool ``[b | 1, 1, group * T, S]``. A query row with no allowed key gets
    zeros, as PyTorch's math kernel gives it. Backward, with ``g`` the output's gradient (the softmax attention
    gradient as in Dao et al. 2022, "FlashAttention", appendix B.2, here with ``p`` kept instead of recomputed):
    ``dv = p^T g``, ``dp = g v^T``, ``ds = p (dp - rowsum(dp p))``, ``dq = scale ds k``, ``dk = scale ds^T q``.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                scale: float) -> torch.Tensor:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
        p = torch.softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1)
        del scores
        p.masked_fill_(~allowed.any(dim=-1, keepdim=True), 0.0)  # no key allowed: 0, not NaN
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, p)
        return torch.matmul(p, v.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, p = ctx.saved_tensors
        grad = grad.float()
        dv = torch.matmul(p.transpose(-1, -2), grad)
        ds = torch.matmul(grad, v.float().transpose(-1, -2))
        ds.sub_((ds * p).sum(dim=-1, keepdim=True)).mul_(p)
        dq = torch.matmul(ds, k.float()).mul_(ctx.scale)
        dk = torch.matmul(ds.transpose(-1, -2), q.float()).mul_(ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None, dtype: torch.dtype) -> Any:
    """transformers' sdpa attention (output ``[b, T, heads, d]``) through :class:`_Float32Attention`; None where
    the call is not one it reproduces (then the caller runs the plain function)."""
    b, heads, t, d = query.shape
    kv_heads, s = key.shape[1], key.shape[2]
    if heads % kv_heads or value.shape[1] != kv_heads:
        return None
    group = heads // kv_heads
    if attention_mask is None:
        if t != s or not getattr(module, "is_causal", True):
            return None  # transformers then crops keys or attends to all: not reproduced here
        allowed = torch.ones(t, s, dtype=torch.bool, device=query.device).tril_()
        allowed = allowed.view(1, 1, 1, t, s)
    elif attention_mask.dtype == torch.bool and attention_mask.dim() == 4 and attention_mask.shape[1] == 1:
        allowed = attention_mask.unsqueeze(2)  # [b|1, 1, 1, T, S]: the same for every head
    else:
        return None
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, kv_heads, group * t, d)
    allowed = allowed.expand(-1, -1, group, -1, -1).reshape(allowed.shape[0], 1, group * t, s)
    out = _Float32Attention.apply(q, key, value, allowed, scale)  # [b, kv_heads, group * T, d]
    return out.view(b, heads, t, d).transpose(1, 2).to(dtype).contiguous()


def _float32_sdpa(plain: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
    device = query.device.type
    scores = query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2] * 4
    if (device != "cpu" or not torch.is_grad_enabled() or not torch.is_autocast_enabled(device)
            or scores > MAX_SCORE_BYTES):
        return plain(module, query, key, value, attention_mask, *args, **kwargs)
    dtype = torch.get_autocast_dtype(device)
    known_call = not args and set(kwargs) <= PLAIN_KWARGS and kwargs.get("is_causal") is not False
    if known_call and not kwargs.get("dropout"):
        with torch.autocast(device, enabled=False):
            out = _grouped_attention(module, query, key, value, attention_mask, kwargs.get("scaling"), dtype)
        if out is not None:
            return out, None
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # an additive mask must match the query's dtype
    # The math kernel, not float32 flash attention: the latter's backward gave run-to-run different key gradients
    # inside the update (never in isolation), and a seed must give the same run.
    with torch.autocast(device, enabled=False), sdpa_kernel(SDPBackend.MATH):
        out, weights = plain(module, query.float(), key.float(), value.float(), attention_mask, *args, **kwargs)
    return out.to(dtype), weights


@contextmanager
def float32_attention(enabled: bool = True) -> Iterator[None]:
    """For the duration, transformers' ``sdpa`` attention runs in float32 in forwards that build a graph on a CPU
    under autocast (module docstring). A no-op when not ``enabled`` or without transformers' attention registry."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        enabled = False
    if not enabled:
        yield
        return
    registry = ALL_ATTENTION_FUNCTIONS
    had_local = SDPA in registry._local_mapping
    previous = registry[SDPA]
    registry[SDPA] = functools.partial(_float32_sdpa, previous)  # a local override on this registry only
    try:
        yield
    finally:
        if had_local:
            registry[SDPA] = previous
        else:
            del registry[SDPA]
