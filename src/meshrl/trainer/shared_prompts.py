"""The update's forward with each distinct prompt run once: its KV cache serves every row that shares it.

A GRPO step has G rollouts per prompt; a padded one-pass forward recomputes the prompt G times and pads
every response to the longest. Here the prompt pass returns the logits of its last position (they predict
response token 0) and its keys/values, which autograd then shares among the rows (gradients summed over
the copies). The responses run either

* **packed** (Llama-family models): responses of one prompt placed end to end in rows as long as the longest
  response, each attending to the prompt and causally to itself only (a boolean 4-D mask), positions
  restarting after the prompt; or
* **bucketed**: sorted by length and cut into ``buckets`` groups where the padding is least, each group
  padded to its own longest response.

Measured on tiny:small GRPO batches (8 prompts x 8 rollouts, 64 new tokens, ~2800 real response tokens): the
update takes 0.37 s one-pass, 0.245 s with 2 equal buckets, 0.214 s with 2 optimally cut buckets and 0.200 s
packed (2 threads); on SmolLM2-135M (2 x 4 rollouts) packing and buckets are equal.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from meshrl.models.lora import base_model

if TYPE_CHECKING:
    from meshrl.trainer.batch import MicroBatch


def shared_prompt_logits(model: torch.nn.Module, mb: MicroBatch, device: torch.device, *, pack: bool = True,
                         buckets: int = 2) -> torch.Tensor | None:
    """Logits ``[n, T, V]`` as :func:`meshrl.trainer.batch.response_logits` defines them, or None when the
    model cannot hand a cache back (the caller then runs the one-pass forward)."""
    from meshrl.models.llama_fast import unsupported_reason

    key = _cache_kwarg(model)
    if key is None or checkpointing(model):
        return None
    passes = HFPasses(model, key)
    if pack and unsupported_reason(model) is None:
        return _packed_logits(passes, mb, device)
    return _bucketed_logits(passes, mb, device, buckets)


def _cache_kwarg(model: torch.nn.Module) -> str | None:
    """Name of the forward argument that takes a KV cache (``cache`` in transformers >= 5,
    ``past_key_values`` before), or None when the model takes neither."""
    return _cache_kwarg_of(type(base_model(model)))


@functools.cache
def _cache_kwarg_of(cls: type) -> str | None:
    params = inspect.signature(cls.forward).parameters  # once per class, not per micro-batch
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def checkpointing(model: torch.nn.Module) -> bool:
    """Gradient checkpointing in training mode: Hugging Face models then ignore ``use_cache``, so there is no
    prompt cache to share."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``[(keys, values)]`` per layer of a full-attention Hugging Face cache; None for any other kind
    (sliding windows, linear attention...), for which the one-pass forward is used."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return None
    return [(layer.keys, layer.values) for layer in layers]


def _distinct_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first row index of each distinct row, distinct index of every row)`` of a 2-D tensor."""
    _, inverse = torch.unique(x, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), x.shape[0], dtype=torch.long)
    first = first.scatter_reduce(0, inverse, torch.arange(x.shape[0]), "amin")
    return first, inverse


class HFPasses:
    """Prompt and response passes through the model's own forward, handing its KV cache back in."""

    def __init__(self, model: torch.nn.Module, key: str):
        self.model, self.key = model, key

    def prompt(self, ids, mask, pos):
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        return out.logits, _cache_layers(getattr(out, "cache", None) or getattr(out, "past_key_values", None))

    def responses(self, prompt_kv, src, ids, mask, pos):
        """Logits of ``ids`` continuing the prompts ``src`` (rows of ``prompt_kv``); ``mask`` is the 2-D padding
        mask over prompt + ids, or a boolean 4-D ``[b, 1, s, P+s]`` attention mask (True = may attend)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (k, v) in enumerate(prompt_kv):
            # index_select, not k[src]: the latter's backward (index_put with accumulate) adds in parallel
            # atomics on a CPU past 32,768 elements, so two identical runs differed in their gradients
            cache.update(k.index_select(0, src), v.index_select(0, src), layer)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          **{self.key: cache}).logits


def length_bucket_cuts(sorted_lengths: list[int], buckets: int) -> list[int]:
    """Cut points ``[0, c1, ..., n]`` that split ascending lengths into at most ``buckets`` contiguous groups
    with the fewest padded tokens, ``sum over groups of size x longest``.

    Dynamic programme over prefixes, ``best_k(j) = min_i best_{k-1}(i) + (j - i) * L[j-1]``, one
    vectorised ``[n+1, n+1]`` step per bucket. On tiny:small GRPO batches (64 rows, a third truncated at the
    cap) 2 buckets pad 3342 tokens where equal halves pad 3936 (2800 real).
    """
    n = len(sorted_lengths)
    if n == 0:
        return [0]
    lens = np.asarray(sorted_lengths, dtype=np.int64)
    j = np.arange(n + 1)
    # cost[i, j]: rows i..j-1 in one group (only i < j is a group); L[j-1] is its longest
    longest = np.concatenate([[0], lens])
    span = (j[None, :] - j[:, None]) * longest[None, :]
    span = np.where(j[:, None] < j[None, :], span, np.iinfo(np.int64).max // 4)
    best = np.full(n + 1, np.iinfo(np.int64).max // 4)
    best[0] = 0
    choices = []
    for _ in range(max(1, buckets)):
        total = best[:, None] + span
        arg = total.argmin(axis=0)
        new = total[arg, j]
        new[0] = 0
        keep = new < best  # one more group must pay for itself, else stay with fewer
        choices.append(np.where(keep, arg, -1))
        best = np.minimum(best, new)
    cuts, end = [n], n
    for arg in reversed(choices):
        if arg[end] >= 0 and end > 0:
            end = int(arg[end])
            cuts.append(end)
    if cuts[-1] != 0:
        cuts.append(0)
    return sorted(set(cuts))


def _prompt_pass(passes, mb: MicroBatch, device: torch.device):
    """``(first row of each distinct prompt, distinct index of every row, logits of each prompt's last
    position [U, 1, V], per-layer prompt keys/values or None)``."""
    p = mb.prompt_len
    # Same ids AND same padding: with pad == eos/bos, [pad, a, b] and [a, b] pad to the same ids.
    first, inverse = _distinct_rows(torch.cat([mb.input_ids[:, :p], mb.attention_mask[:, :p]], dim=1))
    head_logits, prompt_kv = passes.prompt(mb.input_ids[first, :p].to(device),
                                           mb.attention_mask[first, :p].to(device),
                                           mb.position_ids[first, :p].to(device))
    return first, inverse, head_logits, prompt_kv


def _bucketed_logits(passes, mb: MicroBatch, device: torch.device, buckets: int) -> torch.Tensor | None:
    """Logits from one pass over the distinct prompts and one per length bucket of responses; None when the
    prompt pass returns no reusable cache."""
    p, t = mb.prompt_len, mb.response_ids.shape[1]
    _, inverse, head_logits, prompt_kv = _prompt_pass(passes, mb, device)
    if prompt_kv is None:
        return None
    lengths = mb.response_lengths
    order = torch.argsort(lengths, stable=True)
    cuts = length_bucket_cuts(lengths[order].tolist(), buckets)
    parts = []
    for rows in (order[a:b] for a, b in zip(cuts, cuts[1:], strict=False)):
        src = inverse[rows].to(device)
        # [r, 1, V]: the prompt's last position predicts response token 0 (index_select: a deterministic backward)
        first_token = head_logits.index_select(0, src)
        width = int(lengths[rows].max())
        if width <= 1:
            parts.append(F.pad(first_token, (0, 0, 0, t - 1)))
            continue
        logits = passes.responses(prompt_kv, src, mb.response_ids[rows, : width - 1].to(device),
                                  mb.attention_mask[rows, : p + width - 1].to(device),
                                  mb.position_ids[rows, p : p + width - 1].to(device))
        parts.append(F.pad(torch.cat([first_token, logits], dim=1), (0, 0, 0, t - width)))
    return torch.cat(parts)[torch.argsort(order).to(device)]


def pack_responses(prompt_of: list[int], widths: list[int]) -> tuple[list[list[tuple[int, int]]], int]:
    """First-fit-decreasing packing (Johnson 1973; at most 11/9 OPT + 1 rows per prompt) of response segments
    into rows that each continue ONE prompt.

    ``prompt_of[i]`` is row i's distinct prompt, ``widths[i]`` the tokens it feeds (response length - 1;
    0 needs no slot). Returns ``(bins, capacity)``: each bin a list of ``(row, offset)``, all rows of a bin
    sharing a prompt, capacity = the longest width.
    """
    capacity = max(widths, default=0)
    bins: list[list[tuple[int, int]]] = []
    fill: list[int] = []
    open_bins: dict[int, list[int]] = {}
    for row in sorted((r for r in range(len(widths)) if widths[r] > 0), key=lambda r: (-widths[r], r)):
        u, w = prompt_of[row], widths[row]
        target = next((b for b in open_bins.get(u, []) if fill[b] + w <= capacity), None)
        if target is None:
            target = len(bins)
            bins.append([])
            fill.append(0)
            open_bins.setdefault(u, []).append(target)
        bins[target].append((row, fill[target]))
        fill[target] += w
    return bins, capacity


def _packed_logits(passes, mb: MicroBatch, device: torch.device) -> torch.Tensor | None:
    """Logits with the responses packed per prompt (see the module docstring)."""
    t = mb.response_ids.shape[1]
    first, inverse, head_logits, prompt_kv = _prompt_pass(passes, mb, device)
    if prompt_kv is None:
        return None
    out = F.pad(head_logits[inverse.to(device)], (0, 0, 0, t - 1))  # [n, T, V]: response token 0 from the prompt
    widths = (mb.response_lengths - 1).clamp(min=0).tolist()
    bins, cap = pack_responses(inverse.tolist(), widths)
    if not bins:
        return out
    src = torch.tensor([int(inverse[b[0][0]]) for b in bins])
    ids, pos, allowed, target, source = _packed_inputs(mb, bins, cap, widths, mb.attention_mask[first[src]])
    logits = passes.responses(prompt_kv, src.to(device), ids.to(device), allowed.to(device), pos.to(device))
    to_dev = [x.to(device) for x in (*target, *source)]
    return out.index_put((to_dev[0], to_dev[1]), logits[to_dev[2], to_dev[3]])


def _packed_inputs(mb: MicroBatch, bins: list[list[tuple[int, int]]], cap: int, widths: list[int],
                   prompt_mask: torch.Tensor):
    """Packed ids and positions ``[B, cap]``, the attention mask ``[B, 1, cap, P+cap]``, and the
    ``(row, t)`` <- ``(bin, slot)`` map from packed outputs to response positions 1.. of each row."""
    p, nb = mb.prompt_len, len(bins)
    ids = torch.zeros(nb, cap, dtype=torch.long)
    pos = torch.zeros(nb, cap, dtype=torch.long)
    seg = torch.full((nb, cap), -1, dtype=torch.long)
    rows_i, t_i, b_i, c_i = [], [], [], []
    for b, members in enumerate(bins):
        for k, (row, off) in enumerate(members):
            w = widths[row]
            ids[b, off : off + w] = mb.response_ids[row, :w]
            pos[b, off : off + w] = mb.position_ids[row, p : p + w]  # counted from the row's real prompt length
            seg[b, off : off + w] = k
            rows_i += [row] * w
            t_i += range(1, w + 1)
            b_i += [b] * w
            c_i += range(off, off + w)
    causal = torch.ones(cap, cap, dtype=torch.bool).tril()
    own = (seg[:, :, None] == seg[:, None, :]) & causal[None] & (seg[:, :, None] >= 0)
    own |= torch.eye(cap, dtype=torch.bool)[None]  # padding slots see themselves (no empty softmax)
    prompt_keys = prompt_mask[:, :p].bool()[:, None, :].expand(nb, cap, p)
    allowed = torch.cat([prompt_keys, own], dim=2)[:, None]
    as_t = torch.tensor
    return ids, pos, allowed, (as_t(rows_i), as_t(t_i)), (as_t(b_i), as_t(c_i))
