"""Log-probs under the sampler's truncated distribution (top-k, top-p), as vLLM's sampler truncates.

A sampler with ``top_p < 1`` (or ``top_k``) draws from the tempered distribution renormalised over the tokens it
keeps, so its log-prob of a sampled token is ``log softmax(logits / T)[y] - log(kept mass)``. A trainer that
scores the same token over the whole vocabulary sees a gap of ``-log(kept mass)`` on every token: a mismatch
diagnostic that reports truncation as "mismatch", and an importance ratio ``pi_train / pi_sampler`` biased by
``log(kept mass)`` (TRL #6789 / #7269, prime-rl #2979, verl #6240). Taking the trainer's log-prob under the same
truncated distribution (the kept set rebuilt from the trainer's own logits with the sampler's rule) removes the
gap; on the same weights what is left is float noise.

The rule is vLLM's (``apply_top_k_top_p``): scale by ``1 / T``; top-k keeps the logits at least as large as the
k-th largest; top-p sorts ascending, and drops every token whose cumulative probability (over what top-k kept)
is at most ``1 - p``, always keeping the most likely token.
"""

from __future__ import annotations

import torch


def kept_mask(logits: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
              ) -> torch.Tensor:
    """``[..., V]`` bool: the tokens the sampler may draw at each position (all of them without truncation)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    scaled = logits.float() / temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        keep &= scaled >= kth
    if top_p < 1:
        masked = scaled.masked_fill(~keep, float("-inf"))
        sorted_logits, order = masked.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[..., -1] = False  # at least the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        keep &= ~drop
    return keep


def truncated_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, log_kept_mass)``, each shaped like ``tokens``: the log-prob of each token under the tempered
    distribution renormalised over the kept set, and ``log`` of the tempered mass the kept set holds (0 without
    truncation). ``logits [..., V]`` score ``tokens [...]``; a token outside the kept set gets ``-inf`` (the
    sampler could not have drawn it: a near-tie at the nucleus edge between two forwards)."""
    scaled = logits.float() / temperature
    keep = kept_mask(logits, temperature=temperature, top_p=top_p, top_k=top_k)
    full = scaled.logsumexp(dim=-1)
    kept = scaled.masked_fill(~keep, float("-inf")).logsumexp(dim=-1)
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    inside = keep.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(inside, chosen - kept, torch.full_like(chosen, float("-inf")))
    return logp, kept - full
