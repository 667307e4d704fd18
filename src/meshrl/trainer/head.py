"""Per-token log-probs and entropies from the policy's last hidden states, its output head applied in chunks.

The plain path (:func:`meshrl.trainer.batch.response_logits`, then :func:`~meshrl.trainer.batch.token_logprobs`
and :func:`~meshrl.trainer.batch.token_entropy`) holds the response logits ``[n, T, V]`` whole: in float32, plus
the log-softmax that autograd keeps for the backward, plus its gradient there, plus bf16 copies under autocast.
For SmolLM2-135M (V = 49,152) and 32 rollouts of 48 tokens each of those is 302 MB, and together they are the
largest term of the update's peak after the weights and AdamW's state (benchmarks/JOURNAL.md, "Memory:
memory_vs_trl.py (2026-12-04)").

Here the forward runs with the head set aside (:func:`head_set_aside`), so that the same shared-prompt / packed /
one-pass layout yields the hidden states ``[n, T, H]`` (H = 576 for SmolLM2) where it yielded logits. Then, per
chunk of ``chunk`` tokens, the head's logits (under the same autocast), the tempered log-softmax, the sampled
token's log-prob and the entropy are computed exactly as the plain path computes them, row by row, so the values
are the plain path's up to the rounding of a matmul over fewer rows. With a graph, each chunk runs under
:func:`torch.utils.checkpoint.checkpoint`: it keeps only its input hidden states and recomputes its logits in the
backward (Chen et al. 2016, "Training deep nets with sublinear memory cost"), so at most one chunk's logits exist
at a time, at the cost of a second head matmul per token in the backward.

A plain ``nn.Linear`` head (every Llama-family model; not a LoRA-wrapped one) takes a fused path instead,
:class:`LinearTokenTerms`, an autograd function with the log-softmax's backward in closed form: for the sampled
token ``y``, ``d log p_y / d z = (onehot(y) - softmax(z)) / T``, so the backward needs only each token's
log-normaliser from the forward, not the log-softmax, and the entropy (a metric, without gradient) is not
recomputed there. It casts the head's weight once per pass instead of once per chunk, and does the vocabulary-wide
elementwise work in blocks of rows that stay in cache. When the logits take at most ``train.head_keep_mib`` (in
bf16 under autocast: 98 KB per token of a 49k vocabulary) it keeps them for the backward instead of recomputing
them (the same values: the same matmul on the same inputs). The values differ from the plain path's by float rounding
(the log-normaliser is summed in a different order); ``tests/integration/test_head_chunks.py`` compares them.
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
                        autocast_bf16: bool, temperature: float = 1.0, entropy: bool = True,
                        keep_mib: float = 0,
                        positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``[n, T]`` (with a graph when grad is enabled) and, with ``entropy``, entropies
    ``[n, T]`` (detached) of ``tokens`` from hidden states ``[n, T, H]``, ``chunk`` tokens at a time (module
    docstring). A fused head keeps its logits for the backward instead of recomputing them when they take at most
    ``keep_mib`` MiB. ``positions`` (bool ``[n, T]``): compute only there (a micro-batch's real response tokens, not
    its right padding, which can be a third of the positions or more); elsewhere the log-prob and entropy are 0."""
    if chunk < 1:
        raise ValueError(f"train.head_chunk must be >= 1 to chunk the head, got {chunk}")
    n, t = tokens.shape
    flat_h = hidden.reshape(n * t, hidden.shape[-1])
    flat_y = tokens.reshape(n * t).to(hidden.device)
    sel = None if positions is None else positions.reshape(n * t).to(hidden.device, torch.bool)
    if sel is not None and bool(sel.any()):  # (no real token at all: every position, as without positions)
        lp, ent = chunked_token_terms(flat_h[sel][None], flat_y[sel][None], head, chunk=chunk,
                                      autocast_bf16=autocast_bf16, temperature=temperature, entropy=entropy,
                                      keep_mib=keep_mib)
        lp = lp.new_zeros(n * t).masked_scatter(sel, lp.view(-1)).view(n, t)
        return lp, None if ent is None else ent.new_zeros(n * t).masked_scatter(sel, ent.view(-1)).view(n, t)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    if fused_head(head):
        dtype = torch.bfloat16 if autocast_bf16 else head.weight.dtype
        lp, ent = LinearTokenTerms.apply(flat_h, head.weight, head.bias, flat_y, chunk, dtype, temperature, entropy,
                                         int(keep_mib * 2**20))
        return lp.view(n, t), ent.view(n, t) if entropy else None
    logps, entropies = [], []
    for a in range(0, n * t, chunk):
        args = (flat_h[a : a + chunk], flat_y[a : a + chunk], head, autocast_bf16, temperature, entropy)
        lp, ent = checkpoint(_chunk_terms, *args, use_reentrant=False) if grad else _chunk_terms(*args)
        logps.append(lp)
        entropies.append(ent)
    ent_all = torch.cat(entropies).view(n, t) if entropy else None
    return torch.cat(logps).view(n, t), ent_all


def fused_head(head: torch.nn.Module) -> bool:
    """Whether ``head`` takes :class:`LinearTokenTerms`: a plain ``nn.Linear`` (a wrapped one runs its own forward)."""
    return type(head) is torch.nn.Linear


BLOCK_BYTES = 4 << 20  # the float32 rows of the vocabulary-wide elementwise work done at a time: fits in cache


class _Blocks:
    """Row blocks of a chunk's logits, each copied to float32 (and tempered) in one reused buffer: the
    vocabulary-wide work of a block stays in cache and allocates nothing (fresh multi-MB tensors cost page faults)."""

    def __init__(self, vocab: int, temperature: float, device: torch.device) -> None:
        self.step = max(1, BLOCK_BYTES // (4 * vocab))
        self.temperature = temperature if temperature > 0 and temperature != 1.0 else None
        self.buf = torch.empty(self.step, vocab, dtype=torch.float32, device=device)
        self.spare = torch.empty_like(self.buf)

    def __call__(self, z_chunk: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """``(rows, z, spare)``: ``z`` the rows' logits in float32, divided by the sampling temperature (0 counts
        as 1, as in token_logprobs), and a second buffer of the same shape; both overwritten at the next block."""
        for r in range(0, z_chunk.shape[0], self.step):
            rows = slice(r, min(r + self.step, z_chunk.shape[0]))
            z = self.buf[: rows.stop - r].copy_(z_chunk[rows])
            if self.temperature is not None:
                z.div_(self.temperature)
            yield rows, z, self.spare[: rows.stop - r]


class LinearTokenTerms(torch.autograd.Function):
    """``log softmax((h W^T + b) / T)[y]`` per token and the entropy of that distribution, from hidden states
    ``h [N, H]`` and a linear head ``W [V, H]``, ``chunk`` tokens per matmul; the backward in closed form.

    Forward, per row with ``z = (h W^T + b) / T``, ``m = max z``, ``s = sum exp(z - m)``, ``lse = m + log s``:
    ``log p_y = (z_y - m) - log s`` (what ``log_softmax`` computes) and ``H = log s - sum_j e^(z_j - m) (z_j - m) / s``
    (``= -sum_j p_j log p_j``, written as two non-negative terms so that a peaked distribution keeps its digits).
    Backward (the log-softmax's Jacobian): ``dL/dz_j = g (1[j = y] - exp(z_j - lse)) / T`` for ``g = dL/d log p_y``,
    then ``dL/dh = dz W`` and ``dL/dW = dz^T h``, the matmuls in ``dtype`` as autocast runs them (the weight's
    gradient summed over chunks in float32, as autograd sums the chunked path's). The entropy has no gradient.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
                chunk: int, dtype: torch.dtype, temperature: float, entropy: bool,
                keep_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        n, vocab = hidden.shape[0], weight.shape[0]
        # The logits for the backward, when they fit in keep_bytes: it then skips the head's matmul (the same
        # values: that matmul on the same inputs). Only when a gradient will be asked for.
        keep = any(ctx.needs_input_grad[:3]) and n * vocab * dtype.itemsize <= keep_bytes
        kept: list[torch.Tensor] = []
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n if entropy else 0, dtype=torch.float32)
        blocks = _Blocks(vocab, temperature, hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for a in range(0, n, chunk):
                z_chunk = F.linear(hidden[a : a + chunk].to(dtype), w, b)
                if keep:
                    kept.append(z_chunk)
                for rows, z, e in blocks(z_chunk):
                    i = slice(a + rows.start, a + rows.stop)
                    m = z.amax(-1, keepdim=True)
                    shifted = z.sub_(m)  # z - m <= 0
                    s = torch.exp(shifted, out=e).sum(-1, keepdim=True)
                    log_s = s.log()
                    logp[i] = (shifted.gather(-1, tokens[i, None]) - log_s).squeeze(-1)
                    lse[i] = (m + log_s).squeeze(-1)
                    if entropy:  # H = log s - sum_j e_j (z_j - m) / s: a sum of two non-negative terms, no cancellation
                        ent[i] = (log_s - e.mul_(shifted).sum(-1, keepdim=True) / s).squeeze(-1)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse)
        ctx.chunk, ctx.dtype, ctx.temperature, ctx.kept = chunk, dtype, temperature, kept
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, _g_ent: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, tokens, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        chunk, dtype, temperature = ctx.chunk, ctx.dtype, ctx.temperature
        tempered = temperature > 0 and temperature != 1.0
        n, vocab = hidden.shape[0], weight.shape[0]
        g = g_logp.float()
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight: torch.Tensor | None = None  # float32 sums over chunks; the first chunk's product starts them
        d_bias: torch.Tensor | None = None
        blocks = _Blocks(vocab, temperature, hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for k, a in enumerate(range(0, n, chunk)):
                h = hidden[a : a + chunk].to(dtype)
                z_chunk = ctx.kept[k] if ctx.kept else F.linear(h, w, b)  # recomputed: the same kernel, same inputs
                dz = z_chunk if ctx.kept else torch.empty_like(z_chunk)  # a kept chunk, read block by block, takes dz
                for rows, z, _ in blocks(z_chunk):
                    i = slice(a + rows.start, a + rows.stop)
                    grad = z.sub_(lse[i, None]).exp_().mul_(-g[i, None]).scatter_add_(-1, tokens[i, None], g[i, None])
                    dz[rows] = grad.div_(temperature) if tempered else grad  # as autograd divides
                if need_h:
                    d_hidden[a : a + chunk] = dz @ w
                if need_w:  # summed in float32 (exact: bf16 -> f32 is); a float32 copy of the product lives at most
                    # for the add (a CPU makes one inside add_, CUDA converts as it reads), not into the next chunk
                    part = dz.t() @ h
                    d_weight = part.float() if d_weight is None else d_weight.add_(part)
                if need_b:
                    part = dz.sum(0)
                    d_bias = part.float() if d_bias is None else d_bias.add_(part)
        ctx.kept = []  # overwritten by dz: a second backward (retain_graph) recomputes them
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        d_bias = None if d_bias is None else d_bias.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None
