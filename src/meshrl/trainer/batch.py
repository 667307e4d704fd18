"""Tensors for the policy update: collation of (prompt, response) pairs and per-token log-probs.

Layout of one micro-batch (``P`` = longest prompt, ``T`` = longest response)::

    [ left-padded prompt (P) | right-padded response (T) ]

so every response starts at column ``P`` and the logits that predict it are the slice
``logits[:, P-1 : P-1+T]`` (no gather over the vocabulary). Position ids are counted over real tokens
only, so a padded row gets the same positions as the unpadded sequence.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

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

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch on ``device`` (itself when already there): the loss combines the mask and the response
        ids with the model's logits, so on a GPU they must live beside them."""
        if self.input_ids.device == torch.device(device):
            return self
        return MicroBatch(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
                          self.response_ids.to(device), self.response_mask.to(device), self.prompt_len)

    @property
    def num_tokens(self) -> int:
        """Response tokens the loss reads (the model's own: environment tokens are masked)."""
        return int(self.response_mask.sum())

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[n]`` response tokens per row, environment tokens included (what the forward must run over)."""
        return self.attention_mask[:, self.prompt_len :].sum(-1).long()


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
            model_masks: list[list[int] | None] | None = None) -> MicroBatch:
    """Left-pad prompts and right-pad responses into one :class:`MicroBatch`. ``model_masks`` (multi-turn
    episodes): per row, 1 on the tokens the model sampled and 0 on the environment's; the response mask keeps only
    the 1s, so that no loss term, metric or MEI feature reads a tool's output (None: every token is the model's)."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"collate needs equal, non-zero numbers of prompts ({len(prompts)}) and responses")
    if model_masks is not None and len(model_masks) != len(responses):
        raise ValueError(f"collate got {len(model_masks)} model masks for {len(responses)} responses")
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
    for i, m in enumerate(model_masks or []):
        if m is not None:
            if len(m) != len(responses[i]):
                raise ValueError(f"row {i}: model mask of {len(m)} tokens for a response of {len(responses[i])}")
            resp_mask[i, : len(m)] *= torch.tensor(m, dtype=torch.float32)
    return MicroBatch(ids, attn, pos, ids[:, p_len:], resp_mask, p_len)


def response_logits(
    model: torch.nn.Module, mb: MicroBatch, autocast_bf16: bool = False, *, share_prompts: bool = True,
    pack: bool = True, length_buckets: int = 2,
) -> torch.Tensor:
    """Float32 logits ``[n, T, V]`` at the positions that predict each response token.

    With ``share_prompts`` (and a model whose KV cache can be handed back in, as every Hugging Face causal LM
    with full attention), each distinct prompt runs once and its keys/values serve every row that shares it
    (:mod:`meshrl.trainer.shared_prompts`): with ``pack`` (Llama-family models) the responses of one prompt
    are packed into rows under a block-diagonal mask, otherwise they run in ``length_buckets`` groups of
    similar length. The logits equal the one-pass forward's up to float rounding, and so do the gradients
    (autograd sums them over the copies of a prompt); a GRPO group of G rollouts then costs one prompt
    instead of G, and short responses stop paying for the longest one. As in the one-pass form, positions
    past a row's response are padding, masked everywhere.
    """
    from meshrl.trainer.shared_prompts import shared_prompt_logits

    device = next(model.parameters()).device
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast_bf16 else nullcontext()
    with ctx:
        if share_prompts:
            # The sharing's bookkeeping (distinct prompts, packing, index maps) runs on the host; the model's passes
            # and the logits they return are on ``device``.
            logits = shared_prompt_logits(model, mb.to(torch.device("cpu")), device, pack=pack,
                                          buckets=max(1, length_buckets))
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
