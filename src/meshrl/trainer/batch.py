"""Tensors for the policy update: collation of (prompt, response) pairs and per-token log-probs.

Layout of one micro-batch (``P`` = longest prompt, ``T`` = longest response)::

    [ left-padded prompt (P) | right-padded response (T) ]

so every response starts at column ``P`` and the logits that predict it are the slice
``logits[:, P-1 : P-1+T]`` (no gather over the vocabulary). Position ids are counted over real tokens
only, so a padded row gets the same positions as the unpadded sequence.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [n, P+T]
    attention_mask: torch.Tensor  # [n, P+T]
    position_ids: torch.Tensor  # [n, P+T]
    response_ids: torch.Tensor  # [n, T]
    response_mask: torch.Tensor  # [n, T] float 0/1
    prompt_len: int  # P

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> MicroBatch:
    """Left-pad prompts and right-pad responses into one :class:`MicroBatch`."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"collate needs equal, non-zero numbers of prompts ({len(prompts)}) and responses")
    p_len = max(len(p) for p in prompts)
    t_len = max(1, max(len(r) for r in responses))
    n = len(prompts)
    ids = torch.full((n, p_len + t_len), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_len + t_len), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p, dtype=torch.long)
        attn[i, p_len - len(p) : p_len] = 1
        if r:
            ids[i, p_len : p_len + len(r)] = torch.tensor(r, dtype=torch.long)
            attn[i, p_len : p_len + len(r)] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    resp_mask = attn[:, p_len:].to(torch.float32)
    return MicroBatch(ids, attn, pos, ids[:, p_len:], resp_mask, p_len)


def response_logits(
    model: torch.nn.Module, mb: MicroBatch, autocast_bf16: bool = False, *, share_prompts: bool = True,
    length_buckets: int = 2,
) -> torch.Tensor:
    """Float32 logits ``[n, T, V]`` at the positions that predict each response token.

    With ``share_prompts`` (and a model whose KV cache can be handed back in, as every Hugging Face causal LM
    with full attention), each distinct prompt runs once and its keys/values are copied to the rows that
    share it, and the responses run in ``length_buckets`` groups of similar length, each padded only to its
    own longest response. The logits equal the one-pass forward's up to float rounding, and so do the
    gradients (autograd sums them over the copies of a prompt); a GRPO group of G rollouts then costs one
    prompt instead of G, and short responses stop paying for the longest one. As in the one-pass form,
    positions past a row's response are padding (masked everywhere); those past the longest response of
    its bucket are zeros. (meshrl's own Llama blocks, :mod:`meshrl.models.llama_fast`, were measured here
    too: no faster on tiny:small, 12% slower on SmolLM2-135M than the model's forward, so they only decode.)
    """
    device = next(model.parameters()).device
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast_bf16 else nullcontext()
    with ctx:
        if share_prompts and _cache_kwarg(model) is not None and not _checkpointing(model):
            logits = _shared_prompt_logits(_HFPasses(model), mb, device, max(1, length_buckets))
            if logits is not None:
                return logits.float()
        return _one_pass_logits(model, mb, device).float()


def _one_pass_logits(model: torch.nn.Module, mb: MicroBatch, device: torch.device) -> torch.Tensor:
    t = mb.response_ids.shape[1]
    # Only the last T+1 positions' logits are needed (the prompt's last token predicts the first response
    # token): skipping the unembedding of the rest of the prompt saves ~12% of an update (benchmarks/).
    out = model(
        input_ids=mb.input_ids.to(device),
        attention_mask=mb.attention_mask.to(device),
        position_ids=mb.position_ids.to(device),
        use_cache=False,
        logits_to_keep=t + 1,
    )
    return out.logits[:, :t]


def _cache_kwarg(model: torch.nn.Module) -> str | None:
    """Name of the forward argument that takes a KV cache (``cache`` in transformers >= 5,
    ``past_key_values`` before), or None when the model takes neither."""
    forward = getattr(model, "get_base_model", lambda: model)().forward
    params = inspect.signature(forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _checkpointing(model: torch.nn.Module) -> bool:
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


class _HFPasses:
    """Prompt and response passes through the model's own forward, handing its KV cache back in."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.key = model, _cache_kwarg(model)

    def prompt(self, ids, mask, pos):
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        return out.logits, _cache_layers(getattr(out, "cache", None) or getattr(out, "past_key_values", None))

    def responses(self, prompt_kv, src, ids, mask, pos):
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (k, v) in enumerate(prompt_kv):
            cache.update(k[src], v[src], layer)
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


def _shared_prompt_logits(passes, mb: MicroBatch, device: torch.device, buckets: int) -> torch.Tensor | None:
    """Logits ``[n, T, V]`` from one pass over the distinct prompts and one per length bucket of responses;
    None when the prompt pass returns no reusable cache."""
    p, t = mb.prompt_len, mb.response_ids.shape[1]
    # Same ids AND same padding: with pad == eos/bos, [pad, a, b] and [a, b] pad to the same ids.
    first, inverse = _distinct_rows(torch.cat([mb.input_ids[:, :p], mb.attention_mask[:, :p]], dim=1))
    head_logits, prompt_kv = passes.prompt(mb.input_ids[first, :p].to(device),
                                           mb.attention_mask[first, :p].to(device),
                                           mb.position_ids[first, :p].to(device))
    if prompt_kv is None:
        return None
    lengths = mb.response_mask.sum(-1).long()
    order = torch.argsort(lengths, stable=True)
    cuts = length_bucket_cuts(lengths[order].tolist(), buckets)
    parts = []
    for rows in (order[a:b] for a, b in zip(cuts, cuts[1:], strict=False)):
        src = inverse[rows].to(device)
        first_token = head_logits[src]  # [r, 1, V]: the prompt's last position predicts response token 0
        width = int(lengths[rows].max())
        if width <= 1:
            parts.append(F.pad(first_token, (0, 0, 0, t - 1)))
            continue
        logits = passes.responses(prompt_kv, src, mb.response_ids[rows, : width - 1].to(device),
                                  mb.attention_mask[rows, : p + width - 1].to(device),
                                  mb.position_ids[rows, p : p + width - 1].to(device))
        parts.append(F.pad(torch.cat([first_token, logits], dim=1), (0, 0, 0, t - width)))
    return torch.cat(parts)[torch.argsort(order).to(device)]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[y_t]``: ``[n, T, V]``, ``[n, T]`` -> ``[n, T]``.

    Dividing by the sampling temperature makes the trainer's log-probs those of the distribution the
    rollouts were drawn from (as verl does); temperature 0 (greedy) is treated as 1.
    """
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    return logp.gather(-1, tokens.to(logits.device)[..., None]).squeeze(-1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position entropy of ``softmax(logits / temperature)``: ``[n, T, V]`` -> ``[n, T]``."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def micro_weight(
    mode: str, micro_mask: torch.Tensor, mini_tokens: int, mini_nonempty_rows: int, mini_rows: int
) -> float:
    """Weight of one micro-batch's aggregated loss so that accumulating micro-batches equals aggregating
    the whole mini-batch at once, for every aggregation mode.

    token-mean divides by tokens, the seq-mean modes by (non-empty) rows, token-sum by nothing.
    """
    if mode == "token-mean":
        return float(micro_mask.sum()) / max(mini_tokens, 1)
    if mode == "token-sum":
        return 1.0
    if mode == "seq-mean-token-sum-norm":
        return micro_mask.shape[0] / max(mini_rows, 1)
    return float((micro_mask.sum(-1) > 0).sum()) / max(mini_nonempty_rows, 1)
