"""The native decoder with fixed shapes, so that a CUDA graph can replay its decode step.

Why: on a GPU a decode step of a small model is bound by launching its kernels from Python, not by reading the
weights: on an H200 the dynamic loop ran Qwen2.5's 0.5B and 1.5B shapes at about the same rate, at 1-4% of the
bf16 FLOP peak (benchmarks/README.md, "GPU"), where reading the 0.5B shape's bf16 weights once takes ~0.2 ms at
4.8 TB/s. A CUDA graph replays a whole step's kernels with one launch, but every tensor it
touches must keep its shape and its address. So, unlike :class:`meshrl.rollout.native._Decoder`:

* the KV cache and the attention bias are allocated once, at their full length, and **kept between batches** of
  the same size (:meth:`StaticDecoder.fits`); a batch's prefill writes into them;
* a step reads the first ``lb`` cache columns, ``lb`` the step's column rounded up to a multiple of
  ``length_bucket``; the columns not yet written are masked by ``-inf`` in the bias, and the step itself opens
  its own column (an ``index_fill_`` with the column as a tensor), so one graph serves ``length_bucket`` steps;
* the step reads its tokens, positions and column from buffers of fixed address and leaves its logits in one;
* finished rows are compacted out only when the running rows fit a smaller *row bucket* (the batch's rows, then
  the powers of two below), padded with finished rows, which keep decoding unread (as rows between two
  compactions of the dynamic decoder do);
* the sampler's weights are cast once per batch, in place, to autocast's dtype (bf16 sampler weights), the head
  included: no per-step cast of a float32 weight.

Sampling stays outside the graph (:func:`meshrl.rollout.native.sample_with_probs`, with the same per-row noise), so
the draw is the dynamic decoder's. ``capture=False`` runs exactly the ops a graph would replay, eagerly: the CPU
twin of the CUDA path, tested in CI against the dynamic decoder (equal logits to float rounding, equal tokens);
on a GPU, ``benchmarks/gpu_smoke.py`` checks that the graph's samples equal the eager ones bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshrl.models.llama_fast import Gemm, PackedBlock, autocast_dtype
from meshrl.models.lora import base_model
from meshrl.rollout.native import _Decoder

#: cache columns a graph covers: a step reads the written columns rounded up to this. Larger = fewer graphs to
#: capture, more masked columns read per step (the KV cache is small next to the weights at RL's lengths).
LENGTH_BUCKET = 64


def row_buckets(rows: int) -> list[int]:
    """The slot counts a batch of ``rows`` decodes at, largest first: ``rows``, then the powers of two below it."""
    sizes = [rows]
    size = 1 << max(0, (rows - 1).bit_length() - 1)
    while size >= 1:
        if size < rows:
            sizes.append(size)
        size //= 2
    return sizes


def padded_length(total_len: int, bucket: int = LENGTH_BUCKET) -> int:
    """``total_len`` rounded up to a multiple of ``bucket``: batches whose prompts differ by a few tokens then
    share one cache (and its graphs)."""
    return -(-total_len // bucket) * bucket


class StaticDecoder(_Decoder):
    """:class:`meshrl.rollout.native._Decoder` with preallocated, persistent buffers and a bucketed step
    (module docstring). Build one per (rows, padded length); call :meth:`refresh` before each batch after the
    weights changed; :meth:`prefill` then :meth:`decode` as the dynamic decoder's."""

    def __init__(self, model, rows: int, total_len: int, device: torch.device, *, capture: bool,
                 length_bucket: int = LENGTH_BUCKET) -> None:
        total_len = padded_length(total_len, length_bucket)
        super().__init__(model, total_len, device, prepack=False)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graph capture needs a CUDA device, got {device}")
        self.rows, self.total_len, self.length_bucket, self.capture = rows, total_len, length_bucket, capture
        self.device = device
        lm = base_model(model)
        self._low = autocast_dtype(device, next(lm.parameters()).dtype)
        if self.packed is not None:  # every projection in autocast's dtype, o and down included (copies)
            self.packed = [PackedBlock(layer, self._low, cast_all=True) for layer in self.layers]
        # The head in autocast's dtype, once (the dynamic decoder's head casts a float32 weight every step);
        # without autocast, the parameter itself.
        weight = self.head.weight.detach()
        self.head_weight = weight if self._low is None else weight.to(self._low)
        bias = None if self.head.bias is None else self.head.bias.detach()
        self.head_bias = bias if bias is None or self._low is None else bias.to(self._low)
        # The caches come with the first prefill, in the dtype its keys have (autocast's rotary output dtype).
        self.k_full: list[torch.Tensor] = []
        self.v_full: list[torch.Tensor] = []
        self.bias_full = torch.full((rows, self.kv_heads, total_len), -math.inf, dtype=self.cos.dtype,
                                    device=device)
        self.bias = self.bias_full
        self.tokens_in = torch.zeros(rows, dtype=torch.long, device=device)
        self.pos_in = torch.zeros(rows, dtype=torch.long, device=device)
        self.col_in = torch.zeros(1, dtype=torch.long, device=device)
        self.slots = rows
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, rows: int, total_len: int) -> bool:
        """Whether a batch of ``rows`` rows and ``total_len`` columns can reuse these buffers (and graphs)."""
        return rows == self.rows and padded_length(total_len, self.length_bucket) == self.total_len

    @torch.no_grad()
    def refresh(self, model) -> None:
        """Copy the current parameters into the packed weights and the head, in place (the graphs read these
        addresses): the weight sync after an optimiser step. Layers run through their modules (LoRA, qwen3) and
        uncast weights are the parameters themselves, current already."""
        if self.packed is not None:
            for old, layer in zip(self.packed, self.layers, strict=True):
                _copy_packed(old, PackedBlock(layer, self._low, cast_all=True))
        _copy_into(self.head_weight, self.head.weight)
        if self.head_bias is not None:
            _copy_into(self.head_bias, self.head.bias)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, total_len: int) -> torch.Tensor:
        """As the dynamic decoder's, into the persistent buffers: the prompt's keys and values in the first columns
        (the rest zeroed, so that a masked column never multiplies a stale NaN), the bias 0 on real prompt tokens
        and ``-inf`` on padding and on every column not yet generated."""
        p, n = ids.shape[1], rows.shape[0]
        if n != self.rows:
            raise ValueError(f"this static decoder holds {self.rows} rows, the batch has {n}")
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        h, kvs = self.forward(ids, mask, pos)
        if not self.k_full or self.k_full[0].dtype != kvs[0][0].dtype:
            shape = (n, self.kv_heads, self.total_len, self.head_dim)
            self.k_full = [k.new_zeros(shape) for k, _ in kvs]
            self.v_full = [v.new_zeros(shape) for _, v in kvs]
            self.graphs.clear()  # they read the old buffers
        for (k, v), kc, vc in zip(kvs, self.k_full, self.v_full, strict=True):
            kc.zero_()
            vc.zero_()
            kc[:, :, :p], vc[:, :, :p] = k[rows], v[rows]
        self.bias_full.fill_(-math.inf)
        self.bias_full[:, :, :p].masked_fill_(mask.bool()[rows][:, None], 0.0)
        self.k_cache, self.v_cache, self.bias, self.slots = self.k_full, self.v_full, self.bias_full, n
        return self.logits(h[:, -1])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head on the cast copy, in the dynamic decoder's matmul form (``W @ h^T`` for a few rows)."""
        if h.dim() == 2 and self.head_bias is None and h.shape[0] <= 64:
            return torch.mm(self.head_weight, h.t()).t().contiguous()
        return Gemm(self.head_weight, self.head_bias)(h)

    # ------------------------------------------------------------------ compaction by row buckets
    def keep_slots(self, running: torch.Tensor, live: int) -> torch.Tensor | None:
        """The slots to keep when the running rows fit a smaller row bucket (``running`` plus enough finished
        slots to fill it, the first ones, so that few rows move), else None; ``live`` = ``running.sum()``."""
        slots = running.shape[0]
        size = min(b for b in row_buckets(self.rows) if b >= max(live, 1))
        if size >= slots:
            return None
        keep = running.clone()
        finished = (~running[:size]).nonzero()[:, 0]
        keep[finished[: size - live]] = True
        return keep

    def compact(self, keep: torch.Tensor) -> torch.Tensor:
        order = super().compact(keep)
        self.slots = order.shape[0]
        return order

    # ------------------------------------------------------------------ the step
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, col: int) -> torch.Tensor:
        """Next-token logits ``[slots, V]`` of one step (see the dynamic decoder's); with ``capture`` the step is
        a CUDA graph captured on the first use of its (slots, length bucket) and replayed after. The returned
        tensor is the graph's output buffer: read it before the next step."""
        n = tokens.shape[0]
        self.tokens_in[:n].copy_(tokens)
        self.pos_in[:n].copy_(pos)
        self.col_in.fill_(col)
        width = min(self.total_len, -(-(col + 1) // self.length_bucket) * self.length_bucket)
        if not self.capture:
            return self.step(n, width)
        graph = self.graphs.get((n, width))
        if graph is None:
            graph = self.graphs[(n, width)] = self._capture(n, width)
        graph[0].replay()
        return graph[1]

    def step(self, n: int, width: int) -> torch.Tensor:
        """The graph's body: ``n`` slots, cache columns ``[0, width)``; the inputs come from the buffers."""
        kv = self.kv_heads
        self.bias_full[:n].index_fill_(2, self.col_in, 0.0)  # this step's column is real from now on
        bias = self.bias_full[:n, :, :width].reshape(n * kv, 1, width)
        tokens, pos = self.tokens_in[:n], self.pos_in[:n]
        if self.fast_step:
            return self._decode_packed(tokens, pos, -1, bias)
        return self._decode_modules(tokens, pos, -1, bias)

    def _write_kv(self, li: int, k: torch.Tensor, v: torch.Tensor, col: int) -> None:
        n = k.shape[0]
        self.k_full[li][:n].index_copy_(2, self.col_in, k[:, :, None].to(self.k_full[li].dtype))
        self.v_full[li][:n].index_copy_(2, self.col_in, v[:, :, None].to(self.v_full[li].dtype))

    def _read_kv(self, li: int, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, d = self.kv_heads, self.head_dim
        return (self.k_full[li][:n, :, :width].reshape(n * kv, width, d),
                self.v_full[li][:n, :, :width].reshape(n * kv, width, d))

    def _capture(self, n: int, width: int) -> tuple[Any, torch.Tensor]:
        """Capture :meth:`step` for ``(n, width)`` after two eager warm-up runs on a side stream (cuBLAS picks
        its kernels and workspaces outside the capture); the warm-up runs write what a replay writes, so they
        change nothing. All graphs share one memory pool: one step runs at a time and its output is read before
        the next."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(n, width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.step(n, width)
        return graph, out


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` unless ``dst`` is ``src``'s storage already (an uncast parameter)."""
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def _copy_packed(old: PackedBlock, new: PackedBlock) -> None:
    """Copy ``new``'s weights into ``old``'s tensors (same shapes, same dtypes); the norms are parameters."""
    for name in ("qkv", "o", "gate_up", "down"):
        a, b = getattr(old, name), getattr(new, name)
        _copy_into(a.weight, b.weight)
        if a.bias is not None:
            _copy_into(a.bias, b.bias)
