"""The update's attention in float32 under bf16 autocast on a CPU: faster there, and closer to the exact value.

Autocast runs ``scaled_dot_product_attention`` in bf16, where PyTorch picks its flash-attention kernel. On a CPU
that kernel's bf16 backward is slow for the update's short sequences: for SmolLM2-135M's layer (9 heads of 64, 23
rows of 47 response tokens over 81 positions) forward + backward took 22.0 ms in bf16 flash attention and 11.8 ms
with the float32 math kernel on 2 threads (``benchmarks/README.md``, "Step rate"). Thirty such layers were 12% of
an update of the step-rate protocol.

Inside :func:`float32_attention`, every layer that dispatches through transformers' ``sdpa`` attention function
(Llama, Qwen2/3, Mistral, ... all look it up in ``ALL_ATTENTION_FUNCTIONS`` at each forward) gets query, key, value
and a floating mask in float32, runs the same function with autocast off on the math kernel (matmuls and a softmax),
and hands back its output in autocast's dtype, as the bf16 kernel did. Only forwards that build a graph on a CPU
under autocast, with scores of at most :data:`MAX_SCORE_BYTES` per layer, change; anything else calls the plain
function. The result differs from the bf16 path by bf16 rounding and is no further from a float32
model's (query and key leave the rotary embedding in float32 and are no longer rounded to bf16 before their
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


# The largest float32 score matrix [batch, heads, queries, keys] per layer run this way: the math kernel keeps it
# for the backward (30 layers of SmolLM2-135M at the step-rate protocol: 3.3 MB each). Larger ones take the plain
# path, where they are a smaller share of the work anyway.
MAX_SCORE_BYTES = 8 << 20


def _float32_sdpa(plain: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
    device = query.device.type
    scores = query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2] * 4
    if (device != "cpu" or not torch.is_grad_enabled() or not torch.is_autocast_enabled(device)
            or scores > MAX_SCORE_BYTES):
        return plain(module, query, key, value, attention_mask, *args, **kwargs)
    dtype = torch.get_autocast_dtype(device)
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
