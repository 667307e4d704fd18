"""Output-layer gradient features of whole rollouts: the ``bias`` and ``head`` feature maps of MEI.

Layout (both functions): the inputs are *aligned*, i.e. ``logits[b, t]`` is the distribution from
which ``tokens[b, t]`` was sampled (the caller has already dropped the last logit / first token of a
full sequence), and ``mask[b, t] = 1`` marks the response tokens that count (coach-prefix, prompt and
padding positions are 0). Token ids at masked-out positions are ignored (they may be padding such as
``-100``). Everything runs without autograd: these are metrics, not loss terms.

Feature maps (docs/method.md §1.2; the Mesh Learning paper writes v_i for the bias feature)::

    bias:  phi_i = sum_t m_t (e_{y_t} - p_t)            in R^V
    head:  phi_i = sum_t m_t (e_{y_t} - p_t) h_t^T      in R^{V x D}

with ``p_t = softmax(logits_t / temperature)``, ``e_y`` the one-hot of the sampled token and ``h_t``
the final hidden state (the input of the unembedding). ``phi_bias`` is the gradient of
``log pi(tau_i)`` with respect to an additive logit bias ``b`` placed after the temperature division
(``log softmax(z/T + b)``); ``phi_head`` is ``T`` times the gradient with respect to the unembedding
matrix ``W`` of ``z = h W^T`` (the exact gradient is ``phi_head / T``; MEI and cosines do not depend on
that constant).
"""

from __future__ import annotations

import math

import torch

from meshrl.algos import check_mask, check_tensor

DEFAULT_CHUNK = 256


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; float32/bf16/fp16 are computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_inputs(
    logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, temperature: float, chunk_size: int
) -> torch.Tensor:
    """Validate the aligned layout; return the mask as a bool tensor ``[B, T]``."""
    check_tensor("logits", logits, ndim=3)
    check_tensor("tokens", tokens, ndim=2)
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
    if tuple(tokens.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"tokens shape {tuple(tokens.shape)} != logits shape[:2] {tuple(logits.shape[:2])}")
    m = check_mask("mask", mask, tokens.float(), "tokens").bool()
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    used = tokens[m]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= logits.shape[-1]):
        raise ValueError(f"tokens under mask must lie in [0, {logits.shape[-1]}) (the vocabulary of logits)")
    return m


def bias_features(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """The ``bias`` feature map: ``phi_i = sum_t m_t (e_{y_t} - softmax(logits_t / temperature))``.

    Equal to ``d/db sum_t m_t log softmax(logits_t / T + b)[y_t]`` at ``b = 0`` (a logit bias shared by
    all steps). The paper's release computes the same quantity with logits divided by the sampling
    temperature and probabilities accumulated in chunks (docs/method.md §1.4).

    Memory: positions are processed ``chunk_size`` at a time, so the transient softmax holds at most
    ``B x chunk_size x V`` floats on top of the inputs.

    Args:
        logits: ``[B, T, V]`` aligned logits (any float dtype; computed in float32, float64 kept).
        tokens: ``[B, T]`` integer sampled tokens.
        mask: ``[B, T]`` 0/1 response mask.
        temperature: sampling temperature ``> 0``.
        chunk_size: positions per chunk ``>= 1``.
    Returns:
        ``[B, V]`` features (float32, or float64 for float64 logits).
    """
    m = _check_inputs(logits, tokens, mask, temperature, chunk_size)
    dt = _compute_dtype(logits)
    B, T, V = logits.shape
    with torch.no_grad():
        mf = m.to(dt)
        phi = torch.zeros(B, V, dtype=dt, device=logits.device)
        phi.scatter_add_(1, torch.where(m, tokens, 0).long(), mf)
        for s in range(0, T, chunk_size):
            p = torch.softmax(logits[:, s : s + chunk_size].to(dt) / temperature, dim=-1)
            phi -= torch.einsum("btv,bt->bv", p, mf[:, s : s + chunk_size])
    return phi


def bias_features_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """:func:`bias_features` of the logits ``z_t = h_t W^T + b`` of final hidden states, without forming them.

    For trainers whose fused LM head never materialises logits: only the masked-in positions are projected
    through the unembedding, ``chunk_size`` positions at a time, so the transient memory is
    ``chunk_size x V`` and prompt, padding and tool positions cost nothing. Same feature map,
    ``phi_i = sum_t m_t (e_{y_t} - softmax(z_t / T))``, computed in float32 (float64 kept).

    Args:
        hidden: ``[B, T, D]`` final hidden states, aligned with ``tokens`` (``z_t`` scores ``tokens[:, t]``).
        weight: ``[V, D]`` unembedding matrix; bias: ``[V]`` or ``None``.
        tokens, mask, temperature, chunk_size: as in :func:`bias_features`.
    Returns:
        ``[B, V]`` features.
    """
    check_tensor("hidden", hidden, ndim=3)
    check_tensor("weight", weight, ndim=2, finite=False)  # the model's own parameters; a full scan per call
    if weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not project hidden size {hidden.shape[2]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({weight.shape[0]},) (the rows of weight)")
    check_tensor("tokens", tokens, ndim=2)
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
    if tuple(tokens.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"tokens shape {tuple(tokens.shape)} != hidden shape[:2] {tuple(hidden.shape[:2])}")
    m = check_mask("mask", mask, tokens.float(), "tokens").bool()
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    V = weight.shape[0]
    rows, cols = _flat_positions(m)
    used = tokens[rows, cols].long()
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= V):
        raise ValueError(f"tokens under mask must lie in [0, {V}) (the rows of weight)")
    dt = _compute_dtype(hidden)
    with torch.no_grad():
        w = weight.to(dt)
        b = None if bias is None else bias.to(dt)
        phi = torch.zeros(hidden.shape[0], V, dtype=dt, device=hidden.device)
        phi.index_put_((rows, used), torch.ones(rows.numel(), dtype=dt, device=hidden.device), accumulate=True)
        for s in range(0, rows.numel(), chunk_size):
            r, c = rows[s : s + chunk_size], cols[s : s + chunk_size]
            z = hidden[r, c].to(dt) @ w.T
            if b is not None:
                z += b
            phi.index_add_(0, r, torch.softmax(z / temperature, dim=-1), alpha=-1.0)
    return phi


def _flat_positions(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices ``[N]`` of the masked-in positions, in row-major order."""
    rows, cols = m.nonzero(as_tuple=True)
    return rows, cols


def _residual_block(
    logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``[n, V]`` rows ``e_{y_t} - p_t`` for the positions ``(rows, cols)``."""
    dt = _compute_dtype(logits)
    r = -torch.softmax(logits[rows, cols].to(dt) / temperature, dim=-1)
    r[torch.arange(rows.numel(), device=r.device), tokens[rows, cols].long()] += 1.0
    return r


def head_gram(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    proj_dim: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Gram matrix ``Phi_ij = <phi_i, phi_j>_F`` of the ``head`` feature map, without forming ``V x D``.

    Exact (``proj_dim=None``), by the kernel trick on the flattened masked positions::

        Phi_ij = sum_{t in i, s in j} ((e_{y_t} - p_t) . (e_{y_s} - p_s)) * (h_t . h_s)

    evaluated block by block over ``chunk_size`` positions (memory ``O(chunk_size x V)``, time
    ``O(N^2 (V + D))`` for ``N`` masked positions in the batch; only blocks on or above the diagonal
    are computed).

    Sketch (``proj_dim=k``): a TensorSketch (Pham & Pagh 2013, "Fast and scalable polynomial kernels
    via explicit feature maps") of ``vec(phi_i)``: with seeded hashes ``h1: [V] -> [k]``,
    ``h2: [D] -> [k]`` and signs ``s1, s2``, each position contributes
    ``irfft(rfft(CS1(e_y - p)) * rfft(CS2(h)))``, the count sketch of ``(e_y - p) (x) h`` under the
    hash ``(h1 + h2) mod k`` and sign ``s1 s2``; ``z_i`` sums these over the rollout's positions and
    ``Phi_hat = z z^T``. Cost ``O(N (V + D + k log k))``, no ``V x k`` matrix. The estimator is
    unbiased, ``E[Phi_hat_ij] = Phi_ij``, with variance ``c Phi_ii Phi_jj / k`` for a small constant
    ``c`` (Avron, Nguyen & Woodruff 2014 bound the degree-q TensorSketch's second moment by
    ``(2 + 3^q) / k``, i.e. ``c <= 11`` here), so the error on the cosine scale has standard deviation
    ``sqrt(c / k)``. Measured on a small case (B=6, T=12, V=50, D=16, k=2048, 30 seeds): ``c <= 2.9``
    over all entries, relative Frobenius error of the Gram 0.056 mean / 0.080 max, largest cosine-scale
    entry error 0.061 mean / 0.111 max (``tests/unit/test_diagnostics.py`` asserts <= 0.2).

    Args:
        logits: ``[B, T, V]`` aligned logits; tokens, mask: ``[B, T]`` (see the module docstring).
        hidden: ``[B, T, D]`` final hidden states ``h_t`` with ``logits_t = h_t W^T``.
        temperature: ``> 0``; chunk_size: positions per block ``>= 1``.
        proj_dim: ``None`` for the exact Gram, or the sketch size ``k >= 1``.
        seed: seeds the sketch's hashes and signs (drawn on the CPU, so results match across devices).
    Returns:
        ``[B, B]`` float64 Gram matrix.
    """
    m = _check_inputs(logits, tokens, mask, temperature, chunk_size)
    check_tensor("hidden", hidden, ndim=3)
    if tuple(hidden.shape[:2]) != tuple(logits.shape[:2]):
        raise ValueError(f"hidden shape[:2] {tuple(hidden.shape[:2])} != logits shape[:2] {tuple(logits.shape[:2])}")
    if proj_dim is not None and not (isinstance(proj_dim, int) and proj_dim >= 1):
        raise ValueError(f"proj_dim must be None or an integer >= 1, got {proj_dim!r}")
    with torch.no_grad():
        if proj_dim is None:
            return _head_gram_exact(logits, tokens, hidden, m, temperature, chunk_size)
        z = _head_sketch(logits, tokens, hidden, m, temperature, chunk_size, proj_dim, seed)
        return z @ z.T


def _head_gram_exact(
    logits: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, m: torch.Tensor, temperature: float, chunk: int
) -> torch.Tensor:
    B = logits.shape[0]
    dt = _compute_dtype(logits)
    rows, cols = _flat_positions(m)
    gram = torch.zeros(B, B, dtype=torch.float64, device=logits.device)
    starts = range(0, rows.numel(), chunk)
    for a in starts:
        ra, ca = rows[a : a + chunk], cols[a : a + chunk]
        res_a, h_a = _residual_block(logits, tokens, ra, ca, temperature), hidden[ra, ca].to(dt)
        for b in starts:
            if b < a:
                continue
            rb, cb = rows[b : b + chunk], cols[b : b + chunk]
            if b == a:
                res_b, h_b = res_a, h_a
            else:
                res_b, h_b = _residual_block(logits, tokens, rb, cb, temperature), hidden[rb, cb].to(dt)
            k = ((res_a @ res_b.T) * (h_a @ h_b.T)).to(torch.float64)  # [na, nb]
            blk = torch.zeros(B, rb.numel(), dtype=torch.float64, device=k.device).index_add_(0, ra, k)
            blk = torch.zeros(B, B, dtype=torch.float64, device=k.device).index_add_(1, rb, blk)
            gram += blk if b == a else blk + blk.T
    return gram


def _sketch_hashes(n: int, k: int, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded bucket ``[n]`` in ``[0, k)`` and sign ``[n]`` in ``{-1, +1}``, drawn on the CPU."""
    bucket = torch.randint(0, k, (n,), generator=gen)
    sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    return bucket.to(device), sign.to(device)


def _head_sketch(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    m: torch.Tensor,
    temperature: float,
    chunk: int,
    k: int,
    seed: int,
) -> torch.Tensor:
    """``[B, k]`` float64 TensorSketch of ``vec(phi_i)`` (see :func:`head_gram`)."""
    B, _, V = logits.shape
    D = hidden.shape[-1]
    dt, dev = _compute_dtype(logits), logits.device
    gen = torch.Generator().manual_seed(seed)
    h1, s1 = _sketch_hashes(V, k, gen, dev)
    h2, s2 = _sketch_hashes(D, k, gen, dev)
    rows, cols = _flat_positions(m)
    acc = torch.zeros(B, k // 2 + 1, dtype=torch.complex128, device=dev)
    for a in range(0, rows.numel(), chunk):
        ra, ca = rows[a : a + chunk], cols[a : a + chunk]
        res = _residual_block(logits, tokens, ra, ca, temperature)
        cs1 = torch.zeros(ra.numel(), k, dtype=dt, device=dev).index_add_(1, h1, res * s1.to(dt))
        cs2 = torch.zeros(ra.numel(), k, dtype=dt, device=dev).index_add_(1, h2, hidden[ra, ca].to(dt) * s2.to(dt))
        prod = torch.fft.rfft(cs1.double(), dim=1) * torch.fft.rfft(cs2.double(), dim=1)
        acc.index_add_(0, ra, prod)
    return torch.fft.irfft(acc, n=k, dim=1)
