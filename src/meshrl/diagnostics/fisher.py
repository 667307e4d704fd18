"""Exact per-rollout Fisher scores ``U_i = grad_theta log pi(tau_i)`` of a causal LM (the ``full`` map).

Input layout (full sequences, the HF causal-LM convention)::

    input_ids[b, :]       prompt + response (+ padding), [B, L]
    attention_mask[b, :]  1 on real tokens, 0 on padding, [B, L]; passed to the model unchanged
    response_mask[b, t]   1 where token t is a response token that counts, [B, L]; response_mask[:, 0] = 0

The logits at position ``t - 1`` predict token ``t``, so::

    log pi(tau_b) = sum_{t >= 1} response_mask[b, t] * log softmax(logits[b, t - 1] / T)[input_ids[b, t]]

and ``U_b`` is its gradient with respect to the selected parameters, flattened in the order of
``model.named_parameters()`` (tied parameters appear once, with the gradient of all their uses).
The model is any ``torch.nn.Module`` called as ``model(input_ids=..., attention_mask=...)`` returning
an object with ``.logits [B, L, V]`` (Hugging Face causal LMs). It is put in eval mode for the call
(no dropout: the score of a fixed policy) and its mode is restored afterwards.

Sketch (``sketch_dim=k``): a seeded count sketch, i.e. a sparse Rademacher random projection
(Charikar, Chen & Farach-Colton 2002; Clarkson & Woodruff 2013): coordinate ``p`` goes to bucket
``h(p)`` with sign ``s(p)``. Then ``E[z_i . z_j] = U_i . U_j`` and
``Var = (||U_i||^2 ||U_j||^2 + (U_i . U_j)^2 - 2 sum_p U_ip^2 U_jp^2) / k <= 2 ||U_i||^2 ||U_j||^2 / k``,
the same variance as a dense Rademacher projection scaled by ``1/sqrt(k)``, at cost ``O(P)`` per
rollout instead of ``O(P k)``. On the cosine scale the error has standard deviation ``<= sqrt(2 / k)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from meshrl.algos import check_choice, check_tensor

METHODS = ("loop", "vmap")
SKETCH_BLOCK = 1 << 22  # coordinates hashed per block: bounds the sketch's index memory


def _check_layout(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Validate the full-sequence layout; return ``response_mask`` as float ``[B, L]``."""
    for name, x in (("input_ids", input_ids), ("attention_mask", attention_mask), ("response_mask", response_mask)):
        check_tensor(name, x, ndim=2)
        if tuple(x.shape) != tuple(input_ids.shape):
            raise ValueError(f"{name} shape {tuple(x.shape)} != input_ids shape {tuple(input_ids.shape)}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    rm = response_mask.to(torch.float32)
    if ((rm != 0) & (rm != 1)).any():
        raise ValueError("response_mask must contain only 0/1 values")
    if rm.shape[1] and bool(rm[:, 0].any()):
        raise ValueError("response_mask[:, 0] must be 0: the first token has no preceding logits")
    if bool(((rm != 0) & (attention_mask == 0)).any()):
        raise ValueError("response_mask marks positions that attention_mask masks out")
    return rm


def _select_params(model: torch.nn.Module, params: Sequence[str] | None) -> dict[str, torch.nn.Parameter]:
    named = dict(model.named_parameters())
    if params is None:
        sel = {n: p for n, p in named.items() if p.requires_grad}
    else:
        if isinstance(params, str):
            raise ValueError("params must be a sequence of parameter names, not a single string")
        unknown = [n for n in params if n not in named]
        if unknown:
            raise ValueError(f"params names not in model.named_parameters(): {unknown[:5]}")
        sel = {n: named[n] for n in named if n in set(params)}
    if not sel:
        raise ValueError("params selects no parameters")
    return sel


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _seq_logp(logits: torch.Tensor, ids: torch.Tensor, rm: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B]`` response log-prob: logits ``[B, L, V]`` at t-1 predict ids at t, weighted by rm."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    tok = logp.gather(-1, ids[:, 1:, None].long()).squeeze(-1)
    return (tok * rm[:, 1:].to(tok.dtype)).sum(dim=-1)


Params = dict[str, torch.nn.Parameter]


def _scores_loop(
    model: torch.nn.Module, sel: Params, ids: torch.Tensor, am: torch.Tensor, rm: torch.Tensor, temperature: float
) -> torch.Tensor:
    rows = []
    tensors = list(sel.values())
    for b in range(ids.shape[0]):
        with torch.enable_grad():
            logits = model(input_ids=ids[b : b + 1], attention_mask=am[b : b + 1]).logits
            lp = _seq_logp(logits, ids[b : b + 1], rm[b : b + 1], temperature).sum()
            grads = torch.autograd.grad(lp, tensors, allow_unused=True)
        rows.append(torch.cat([_flat(g, p) for g, p in zip(grads, tensors, strict=True)]))
    return torch.stack(rows)


def _flat(g: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    return torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if g is None else g.detach().reshape(-1)


def _scores_vmap(
    model: torch.nn.Module,
    sel: Params,
    ids: torch.Tensor,
    am: torch.Tensor,
    rm: torch.Tensor,
    temperature: float,
    chunk: int | None,
) -> torch.Tensor:
    """torch.func per-sample gradients, one vmap per distinct attention-mask row (HF mask code
    branches on the mask's values, which vmap cannot trace when the mask itself is batched)."""
    from torch.func import functional_call, grad, vmap

    frozen = {n: p.detach() for n, p in model.named_parameters() if n not in sel}
    frozen |= dict(model.named_buffers())

    def logp(theta: dict, row_ids: torch.Tensor, mask: torch.Tensor, row_rm: torch.Tensor) -> torch.Tensor:
        kwargs = {"input_ids": row_ids[None], "attention_mask": mask[None]}
        out = functional_call(model, theta | frozen, args=(), kwargs=kwargs)
        return _seq_logp(out.logits, row_ids[None], row_rm[None], temperature)[0]

    theta = {n: p.detach() for n, p in sel.items()}
    per_grad = vmap(grad(logp), in_dims=(None, 0, None, 0), chunk_size=chunk)
    first = next(iter(sel.values()))
    out = torch.empty(ids.shape[0], sum(p.numel() for p in sel.values()), dtype=first.dtype, device=first.device)
    patterns, which = torch.unique(am, dim=0, return_inverse=True)
    for k in range(patterns.shape[0]):
        rows = (which == k).nonzero(as_tuple=True)[0]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="There is a performance drop")
            g = per_grad(theta, ids[rows], patterns[k], rm[rows])
        out[rows.to(out.device)] = torch.cat([g[n].reshape(rows.numel(), -1) for n in sel], dim=1).to(out)
    return out


def count_sketch(U: torch.Tensor, sketch_dim: int, seed: int = 0) -> torch.Tensor:
    """Seeded count sketch ``[B, k]`` of the rows of ``U [B, P]`` (see the module docstring).

    Hashes and signs are drawn on the CPU in blocks of ``SKETCH_BLOCK`` coordinates from one
    generator, so the sketch of a given ``(P, k, seed)`` is the same on every device and the index
    memory stays bounded. Output in float64.
    """
    check_tensor("U", U, ndim=2)
    if not (isinstance(sketch_dim, int) and sketch_dim >= 1):
        raise ValueError(f"sketch_dim must be an integer >= 1, got {sketch_dim!r}")
    gen = torch.Generator().manual_seed(seed)
    z = torch.zeros(U.shape[0], sketch_dim, dtype=torch.float64, device=U.device)
    for s in range(0, U.shape[1], SKETCH_BLOCK):
        n = min(SKETCH_BLOCK, U.shape[1] - s)
        bucket = torch.randint(0, sketch_dim, (n,), generator=gen).to(U.device)
        sign = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(U.device, torch.float64)
        z.index_add_(1, bucket, U[:, s : s + n].to(torch.float64) * sign)
    return z


def fisher_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    params: Sequence[str] | None = None,
    sketch_dim: int | None = None,
    seed: int = 0,
    method: str = "loop",
    vmap_chunk: int | None = None,
) -> torch.Tensor:
    """Per-rollout score ``U_i = grad_theta sum_t log pi(y_t)`` over the response tokens, ``[B, P]``.

    Args:
        model: HF-style causal LM (see the module docstring for the layout and the mode handling).
        input_ids, attention_mask, response_mask: ``[B, L]`` full sequences (module docstring).
        temperature: the policy's sampling temperature ``> 0`` (logits are divided by it).
        params: parameter names to differentiate (default: every parameter with ``requires_grad``);
            ``P`` is their total size, in ``named_parameters()`` order.
        sketch_dim: ``None`` for the exact ``U``, or ``k`` for its count sketch ``[B, k]`` (float64).
            The exact ``[B, P]`` is still formed first (memory ``B x P``): for large models restrict
            ``params`` as well; the sketch makes the kernels and anything stored ``O(B k)``.
        seed: seeds the sketch.
        method: ``"loop"`` (one forward + backward per rollout, the reference) or ``"vmap"``
            (``torch.func.vmap(grad(...))``, one vmap per distinct attention-mask row).
        vmap_chunk: ``chunk_size`` of the vmap (bounds its memory); ``None`` = all rows at once.
    Returns:
        ``[B, P]`` scores in the parameters' dtype, or ``[B, sketch_dim]`` float64.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    rm = _check_layout(input_ids, attention_mask, response_mask)
    check_choice("method", method, METHODS)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if sketch_dim is not None and not (isinstance(sketch_dim, int) and sketch_dim >= 1):
        raise ValueError(f"sketch_dim must be None or an integer >= 1, got {sketch_dim!r}")
    sel = _select_params(model, params)
    run: Callable[..., torch.Tensor] = _scores_loop if method == "loop" else _scores_vmap
    extra = () if method == "loop" else (vmap_chunk,)
    with _eval_mode(model):
        U = run(model, sel, input_ids, attention_mask, rm.to(input_ids.device), temperature, *extra)
    return U if sketch_dim is None else count_sketch(U, sketch_dim, seed)
