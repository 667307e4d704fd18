"""Rollouts with meshrl's own KV-cached decode loop, for Llama-family decoders (CPU or GPU).

Why not ``generate``: for the small models RL runs on a CPU, a ``generate`` step is mostly overhead
around small matmuls, and it keeps computing every row until the longest one ends. This loop

* prefills each *distinct* prompt once and copies its KV cache to the ``n`` samples (a group of G
  rollouts shares its prompt);
* writes keys/values into a preallocated cache (no per-step concatenation);
* drops finished rows from the batch (compacting the cache once enough rows have ended), so a step
  costs the rows still running, not the longest one;
* samples from ``softmax(logits / T)`` with optional top-p, exactly the distribution the trainer scores;
  asked (``generate(..., features=True)``), it also sums MEI's ``bias`` features of every row from that
  distribution (``Rollouts.engine_features``), so that the trainer's update need not recompute them.
* on a CPU, splits the rows over forked decoders (:mod:`meshrl.forkpool`): small decode
  matmuls use one BLAS thread however many torch has, so separate processes are what uses the other cores.

The blocks run through :class:`meshrl.models.llama_fast.LlamaRunner` on the model's own parameters (fused
weights for plain layers, the model's modules for peft LoRA layers), and the backend checks itself once
against the model's own forward (:meth:`NativeDecodeBackend.verify`). On a GPU the loop runs the static decoder
instead (:mod:`meshrl.rollout.static_decode`: fixed shapes, its step replayed as a CUDA graph). Supported:
``model_type`` in
:data:`meshrl.models.llama_fast.SUPPORTED_TYPES` with full attention everywhere and a static RoPE;
anything else is refused with the reason (``rollout.backend=auto`` then falls back to ``hf``; where it picks
``vllm`` instead: :mod:`meshrl.rollout.choice`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from meshrl.forkpool import ForkPool, WorkerDied, fork_available
from meshrl.models.llama_fast import LlamaRunner, rms, unsupported_reason
from meshrl.models.lora import base_model
from meshrl.rollout.base import Rollouts, SamplingParams, register_backend
from meshrl.rollout.hf import InProcessBackend, eval_mode, in_process_settings, left_pad

if TYPE_CHECKING:
    from meshrl.rollout.static_decode import StaticDecoder

log = logging.getLogger("meshrl")

# Compact the KV cache once this fraction of the running rows has finished. A compaction copies only the
# rows it moves (_Decoder.compact) plus a few small ops; each dropped row saves its remaining steps. On
# tiny:small (32 rows, 64 steps) 1/16 to 1/4 measured within 3% of each other.
COMPACT_FRACTION = 0.0625
DECODERS = ("auto", "static", "dynamic")  # static: meshrl.rollout.static_decode; auto = static on a CUDA device
MAX_DEFAULT_WORKERS = 8  # decoders started by default (each shard is >= 16 rows, so more rarely pay)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [n, V]``: argmax when greedy, else a draw from ``softmax(logits / T)``
    restricted to the smallest set of tokens whose mass reaches ``top_p`` (nucleus sampling, Holtzman et al.
    2020; the most likely token is always kept); with ``top_k`` > 0, restricted by vLLM's top-k-then-top-p rule
    (:func:`meshrl.rollout.truncation.kept_mask`). See :func:`sample_with_logprobs`."""
    return sample_with_logprobs(logits, params, noise)[0]


def sample_with_logprobs(logits: torch.Tensor, params: SamplingParams,
                         noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [n], logp [n])``: the draw of :func:`sample_tokens` and the sampled token's log-prob
    ``log softmax(logits / T)[y]`` (float32; ``T = 1`` when greedy), over the whole vocabulary, *before* the
    top-p cut: the distribution the trainer scores (``meshrl.trainer.batch.token_logprobs``), so that the two
    can be compared token for token. It costs a gather: the kept probabilities are not renormalised, so the
    sampled token's entry of ``probs`` is still its tempered probability.

    The draw is the exponential race ``argmax_v p_v / E_v`` with ``E_v ~ Exp(1)`` i.i.d., which picks ``v``
    with probability ``p_v / sum(p)`` (it is how ``torch.multinomial`` draws one sample). ``noise [n, V]``
    supplies the ``E``; without it they come from torch's global generator.
    """
    tokens, logp, _ = sample_with_probs(logits, params, noise, full_probs=False)
    return tokens, logp


def sample_with_probs(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None = None, *,
                      full_probs: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(tokens, logp, probs)``: :func:`sample_with_logprobs` plus the whole-vocabulary distribution the
    log-prob is taken under, ``softmax(logits / T)`` ``[n, V]`` in float32 (``T = 1`` when greedy; before any
    top-p/top-k cut), which the ``bias`` features of MEI need (:func:`meshrl.diagnostics.bias_features`); None
    without ``full_probs``. The draw does not depend on ``full_probs``."""
    if params.greedy:
        tokens = logits.argmax(-1)
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        return tokens, logp_all.gather(-1, tokens[:, None])[:, 0], logp_all.exp() if full_probs else None
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    full = probs
    if params.top_k > 0:  # top-k, then top-p over what it kept: vLLM's rule
        from meshrl.rollout.truncation import kept_mask

        keep = kept_mask(logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        probs = probs.masked_fill(~keep, 0.0)
    elif params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more likely tokens
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if noise is None:
        noise = torch.rand_like(probs).clamp_min_(2.0**-25).log_().neg_()
    tokens = (probs / noise).argmax(-1)
    return tokens, full.gather(-1, tokens[:, None])[:, 0].log(), full if full_probs else None


class RowNoise:
    """Exponential noise for :func:`sample_tokens` that depends only on ``(seed, row, step)``.

    ``row`` is the sample's index in the ``generate`` call, so a row gets the same draw however the rows
    are chunked (``batch_size``), split across decode workers, or compacted as others finish. Rows come in blocks
    of ``block`` with one generator seeding per block and step, which keeps the cost at a few calls a step.
    """

    def __init__(self, seed: int, vocab: int, device: torch.device, block: int = 16):
        self.seed, self.vocab, self.device, self.block = seed, vocab, device, block
        self.gen = torch.Generator(device=device)

    def __call__(self, rows: torch.Tensor, step: int) -> torch.Tensor:
        """Noise ``[len(rows), V]`` for the global row indices ``rows`` (int64 tensor) at decode step ``step``."""
        return self.draw(self.plan(rows), step)

    def plan(self, rows: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """``(blocks, where)`` for :meth:`draw`: the blocks ``rows`` fall in, and each row's index into the
        blocks' stacked noise. Rows change only when finished ones are dropped, so a plan serves many steps."""
        blocks, inverse = torch.unique(torch.div(rows, self.block, rounding_mode="floor"), return_inverse=True)
        return blocks.tolist(), inverse * self.block + rows % self.block

    def draw(self, plan: tuple[list[int], torch.Tensor], step: int) -> torch.Tensor:
        """Noise ``[len(rows), V]`` at ``step`` for the rows :meth:`plan` was made for."""
        blocks, where = plan
        parts = []
        for b in blocks:
            self.gen.manual_seed(((self.seed * 1_000_003 + b) * 65_537 + step) % (2**63 - 1))
            # -log U with U ~ U[0, 1) on a 2^-24 grid is Exp(1) truncated at 16.6 (mass 6e-8 lost); it costs a
            # fifth of Tensor.exponential_ (2.7 vs 14.9 ms for 16 rows x 49k tokens).
            u = torch.rand(self.block, self.vocab, generator=self.gen, device=self.device)
            parts.append(u.clamp_min_(2.0**-25).log_().neg_())  # U = 0 would give E = inf, p/E = 0 everywhere
        noise = parts[0] if len(parts) == 1 else torch.cat(parts)
        return noise[where]


class _Decoder(LlamaRunner):
    """A :class:`LlamaRunner` plus the per-batch preallocated KV cache of the rows being decoded."""

    def __init__(self, model, total_len: int, device: torch.device, prepack: bool = False):
        super().__init__(model, total_len, device, prepack=prepack)
        self.fast_step = (self.packed is not None and self.packed[0].q_norm is None
                          and type(self.inner.embed_tokens) is torch.nn.Embedding)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # Additive attention bias [n, KV, total_len]: -inf on prompt padding, 0 on real and generated keys
        # (a step at column c reads columns <= c only, all written by then).
        self.bias = torch.empty(0)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, total_len: int) -> torch.Tensor:
        """Run the distinct prompts ``ids [U, P]`` (left-padded, ``mask`` 1 on real tokens), store their keys
        and values for the sampled rows (``rows[i]`` = prompt of row i) and return next-token logits ``[U, V]``."""
        p, n = ids.shape[1], rows.shape[0]
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        h, kvs = self.forward(ids, mask, pos)
        for k, v in kvs:
            kc = k.new_zeros(n, self.kv_heads, total_len, self.head_dim)
            vc = v.new_zeros(n, self.kv_heads, total_len, self.head_dim)
            kc[:, :, :p], vc[:, :, :p] = k[rows], v[rows]
            self.k_cache.append(kc)
            self.v_cache.append(vc)
        bias = torch.zeros(n, total_len, dtype=self.cos.dtype, device=ids.device)
        bias[:, :p].masked_fill_(~mask.bool()[rows], -math.inf)
        self.bias = bias[:, None].expand(n, self.kv_heads, total_len).contiguous()
        return self.logits(h[:, -1])

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, col: int) -> torch.Tensor:
        """One step for the running rows: ``tokens [n]`` at positions ``pos [n]`` written to cache column
        ``col``. Returns next-token logits ``[n, V]``."""
        n, kv = tokens.shape[0], self.kv_heads
        bias = self.bias[:, :, : col + 1].view(n * kv, 1, col + 1)
        if self.fast_step:
            return self._decode_packed(tokens, pos, col, bias)
        return self._decode_modules(tokens, pos, col, bias)

    def _decode_packed(self, tokens: torch.Tensor, pos: torch.Tensor, col: int, bias: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` for plain blocks, in the one-token layout ``[n, heads, d]``: no transposes or
        selects, RoPE as ``x cos + roll(x, d/2) sin_signed``, raw weights instead of module calls. A decode
        step of a small model costs its op count (~35 ops a block here) more than its FLOPs."""
        n, kv, d, heads = tokens.shape[0], self.kv_heads, self.head_dim, self.n_heads
        x = F.embedding(tokens, self.inner.embed_tokens.weight)
        cos, sin = self.cos[pos][:, None], self.sin_signed[pos][:, None]  # [n, 1, d]
        for li, pk in enumerate(self.packed):
            qkv = pk.qkv(rms(x, pk.norm1)).view(n, heads + 2 * kv, d)
            qk = qkv[:, : heads + kv]
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
            attn = self._attend_cached(li, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :], col, bias)
            x = pk.o.add_to(x, attn.view(n, heads * d))
            gate, up = pk.gate_up(rms(x, pk.norm2)).chunk(2, dim=-1)
            x = pk.down.add_to(x, F.silu(gate) * up)
        return self.logits(self.inner.norm(x))

    def _decode_modules(self, tokens: torch.Tensor, pos: torch.Tensor, col: int, bias: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` through :meth:`LlamaRunner.qkv` / :meth:`LlamaRunner.block_tail` (LoRA, qwen3)."""
        n, d = tokens.shape[0], self.head_dim
        x = self.inner.embed_tokens(tokens)[:, None]
        rope = self.rope(pos[:, None])
        for li in range(len(self.layers)):
            q, k, v = self.qkv(li, x, rope)
            attn = self._attend_cached(li, q[:, :, 0], k[:, :, 0], v[:, :, 0], col, bias)
            x = self.block_tail(li, x, attn.view(n, self.n_heads, 1, d))
        return self.logits(self.inner.norm(x[:, 0]))

    def _attend_cached(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, col: int,
                       bias: torch.Tensor) -> torch.Tensor:
        """Write this step's ``k, v [n, KV, d]`` to cache column ``col`` of block ``li`` and attend with
        ``q [n, H, d]`` over columns ``0..col``; returns ``[n * KV, H / KV, d]``. GQA without repeating the
        cache: the query heads of one kv head form a ``[group, d]`` block, and the (row, kv head) pairs are
        the batch of one ``baddbmm`` that also adds the ``-inf`` padding ``bias [n * KV, 1, col + 1]``."""
        n, kv, d = q.shape[0], self.kv_heads, self.head_dim
        self._write_kv(li, k, v, col)
        keys, values = self._read_kv(li, n, bias.shape[-1])
        low = values.dtype != torch.float32  # bf16 weights or autocast: softmax in float32, back for the bmm
        scores = torch.baddbmm(bias.to(q.dtype) if low else bias, q.reshape(n * kv, -1, d), keys.transpose(1, 2),
                               alpha=self.scale)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
        return torch.bmm(weights.to(values.dtype) if low else weights, values)

    def _write_kv(self, li: int, k: torch.Tensor, v: torch.Tensor, col: int) -> None:
        """This step's keys and values ``[n, KV, d]`` into cache column ``col`` of block ``li``."""
        self.k_cache[li][:, :, col] = k
        self.v_cache[li][:, :, col] = v

    def _read_kv(self, li: int, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``li``'s keys and values of columns ``[0, width)`` as ``[n * KV, width, d]`` (a view: the cache's
        row stride is ``KV`` times its head stride)."""
        kv, d = self.kv_heads, self.head_dim
        return (self.k_cache[li][:, :, :width].reshape(n * kv, width, d),
                self.v_cache[li][:, :, :width].reshape(n * kv, width, d))

    def keep_slots(self, running: torch.Tensor, live: int) -> torch.Tensor | None:
        """The slots to keep if the cache should be compacted now (``running`` once at least
        :data:`COMPACT_FRACTION` of the slots have finished), else None; ``live`` = ``running.sum()``, which the
        loop has already read (one host sync a step, not two)."""
        slots = running.shape[0]
        if slots - live >= max(1, math.ceil(COMPACT_FRACTION * slots)):
            return running
        return None

    def compact(self, running: torch.Tensor) -> torch.Tensor:
        """Drop the finished rows from the cache: running rows past the first ``m = running.sum()`` slots move
        into the finished slots among the first ``m`` (a copy of the moved rows only, not of the whole cache),
        and the cache becomes its first ``m`` rows. Returns the old slot of each new slot ``[m]``."""
        m = int(running.sum())
        holes = (~running[:m]).nonzero()[:, 0]
        movers = running[m:].nonzero()[:, 0] + m
        order = torch.arange(m, device=running.device)
        if holes.numel():
            order[holes] = movers
            for cache in (*self.k_cache, *self.v_cache, self.bias):
                cache[holes] = cache[movers]
        self.k_cache = [c[:m] for c in self.k_cache]
        self.v_cache = [c[:m] for c in self.v_cache]
        self.bias = self.bias[:m]
        return order


def _add_bias_features(phi: torch.Tensor, slot_row: torch.Tensor, running: torch.Tensor, tokens: torch.Tensor,
                       probs: torch.Tensor) -> None:
    """``phi[slot_row[s]] += e_{tokens[s]} - probs[s]`` for the running slots ``s`` (in place): one step of
    :func:`meshrl.diagnostics.bias_features` on the output rows of the decoder's (compacted) slots. One
    ``[slots, V]`` pass while every slot runs (finished slots are few: compaction drops them)."""
    live = running.nonzero()[:, 0]
    rows = slot_row[live]
    if live.numel() == running.numel():
        phi.index_add_(0, rows, probs, alpha=-1.0)
    else:
        phi.index_add_(0, rows, probs.index_select(0, live), alpha=-1.0)
    phi.index_put_((rows, tokens[live]), torch.ones_like(rows, dtype=phi.dtype), accumulate=True)


def native_settings(rollout: Any) -> dict[str, Any]:
    """The native decoder's keywords from a run's rollout settings."""
    return {"workers": rollout.decode_workers or None, "prepack": rollout.prepack_weights, "decoder": rollout.decoder}


def distinct_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """``(distinct prompts in first-seen order, index of each input prompt among them)``."""
    index: dict[tuple[int, ...], int] = {}
    inverse = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(k) for k in index], inverse


@register_backend("native")
class NativeDecodeBackend(InProcessBackend):
    """meshrl's decode loop behind the rollout interface (see the module docstring).

    ``batch_size`` bounds the sampled rows per batch (None: all at once); ``autocast`` ("bfloat16") runs
    the forward passes under ``torch.autocast``. ``verify=True`` compares the loop's logits with the model's
    own forward on the first batch and raises if they differ beyond float tolerance. ``prepack``: on a CPU
    with oneDNN the decoder's matmuls run on weights reordered once per batch
    (:class:`meshrl.models.llama_fast.PrepackedGemm`: faster at few rows, bit for bit under bf16 autocast,
    ~1e-6 relative rounding in float32; a copy of the weights per decoding process while it decodes). On a CPU
    the rows are decoded in ``workers`` shards at once, the first here and the others in forked processes
    (default: one per torch thread; :mod:`meshrl.forkpool`). Samples depend on the seed and the row only
    (:class:`RowNoise`), not on ``batch_size`` or ``workers``, up to float rounding of the logits (other
    batch shapes round differently, which can flip a near-tie). ``decoder``: ``"static"``
    (:mod:`meshrl.rollout.static_decode`; eagerly on a CPU, the GPU path's twin), ``"dynamic"`` (this module's
    loop) or ``"auto"`` (static on a CUDA device, else dynamic).
    """

    name = "native"

    def __init__(self, model, tokenizer, *, batch_size: int | None = None, autocast: str | None = None,
                 verify: bool = True, workers: int | None = None, prepack: bool = True, decoder: str = "auto"):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"rollout backend 'native' cannot run this model: {reason}; use 'hf'")
        super().__init__(model, tokenizer, batch_size=batch_size, autocast=autocast)
        self._verified = not verify
        self.prepack = prepack
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
        on_cuda = next(model.parameters()).device.type == "cuda"
        # The static decoder pays on a GPU (its step as one CUDA graph); on a CPU it is the twin the tests run.
        self.static = decoder == "static" or (decoder == "auto" and on_cuda)
        self.capture_graphs = on_cuda  # False: the static decoder's step eagerly (the graph's reference)
        self._static: StaticDecoder | None = None
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1 or None, got {workers}")
        # One decoder per torch thread on a CPU (forked processes, see meshrl.forkpool); a GPU runs the batch as one.
        cpu = next(model.parameters()).device.type == "cpu"
        default = min(torch.get_num_threads(), MAX_DEFAULT_WORKERS) if fork_available() else 1
        self.workers = (workers or default) if cpu else 1
        self._pool: ForkPool | None = None

    @classmethod
    def from_config(cls, rollout: Any, model, tokenizer, **context: Any) -> NativeDecodeBackend:
        return cls(model, tokenizer, **in_process_settings(rollout), **native_settings(rollout))

    def verify(self, prompts: list[list[int]], new_tokens: int = 4, atol: float | None = None) -> float:
        """Greedy-decode ``new_tokens`` with the loop, score the same sequences with the model's own forward
        and return the largest logit difference; raise ``RuntimeError`` above ``atol`` (a layout this loop
        misreads must fail loudly, not sample from a different policy). Default ``atol``: 1e-3 in float32;
        with bf16/fp16 weights or autocast, where the two orders of rounding differ by a few bf16 ulps,
        5% of the largest logit (SmolLM2-135M: 0.77 of ~25; a misread layout is off by the logits' own scale)."""
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        device = self.device
        ids, mask = left_pad(prompts, self.pad_id, device)
        with eval_mode(self.model), torch.inference_mode(), self._autocast():
            tokens, _, step_logits, _ = self._decode_batch(prompts, params, record_logits=True, stop_at_eos=False)
            full = torch.cat([ids, tokens], dim=1)
            full_mask = torch.cat([mask, torch.ones_like(tokens)], dim=1)
            pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
            ref = self.model(input_ids=full, attention_mask=full_mask, position_ids=pos).logits
        ref = ref[:, ids.shape[1] - 1 : ids.shape[1] - 1 + tokens.shape[1]].float()
        diff = float((torch.stack(step_logits, dim=1).float() - ref).abs().max())
        low_precision = self.autocast is not None or next(self.model.parameters()).dtype != torch.float32
        if atol is None:
            atol = 0.05 * max(1.0, float(ref.abs().max())) if low_precision else 1e-3
        if not diff <= atol:
            raise RuntimeError(f"native decode disagrees with the model's forward (max |logit diff| {diff:.3g} > "
                               f"{atol}); use rollout.backend=hf for this model")
        self._verified = True
        return diff

    @torch.no_grad()
    def _decode_batch(self, prompts: list[list[int]], params: SamplingParams, *, noise: RowNoise | None = None,
                      first_row: int = 0, record_logits: bool = False, stop_at_eos: bool = True,
                      features: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """Sampled tokens ``[rows, max_new_tokens]`` (eos, then pad after a row ends) for the prompts, whose
        rows are ``first_row, first_row + 1, ...`` of the call (for ``noise``), their log-probs (float32, same
        shape, 0 after a row ends; :func:`sample_with_logprobs`); with ``record_logits`` also the logits of
        every step (``stop_at_eos=False`` keeps every row running); with ``features`` the ``bias`` features of
        MEI of every row, ``phi = sum_t (e_{y_t} - softmax(z_t / T))`` over its response tokens (up to and
        including its eos; ``[rows, V]`` float32, else None): a step adds ``e_y - p`` for the rows still
        running, from the distribution it samples from anyway, so the features cost one ``[rows, V]`` update a
        step and no forward pass. The draw does not depend on ``features``."""
        device = self.device
        distinct, inverse = distinct_prompts(prompts)
        ids, mask = left_pad(distinct, self.pad_id, device)
        rows = torch.tensor(inverse, device=device)
        width, steps = ids.shape[1], params.max_new_tokens
        dec = self._decoder(len(prompts), width + steps)
        logits = dec.prefill(ids, mask, rows, width + steps)[rows]
        n = rows.shape[0]
        out = torch.full((n, steps), self.pad_id, dtype=torch.long, device=device)
        out_logp = torch.zeros((n, steps), dtype=torch.float32, device=device)
        pos = mask.sum(-1)[rows]  # next position = number of real tokens so far
        slot_row = torch.arange(n, device=device)  # output row of each running slot
        running = torch.ones(n, dtype=torch.bool, device=device)  # False: ended, awaiting compaction
        eos = torch.tensor(self.eos if stop_at_eos else [], dtype=torch.long, device=device)
        recorded: list[torch.Tensor] = []
        phi = torch.zeros((n, logits.shape[-1]), dtype=torch.float32, device=device) if features else None
        sampled = noise is not None and not params.greedy
        plan = noise.plan(slot_row + first_row) if sampled else None
        for t in range(steps):
            if record_logits:  # a copy: a static decoder's logits live in a buffer the next step overwrites
                recorded.append(logits.float().clone())
            step_noise = noise.draw(plan, t) if sampled else None
            tokens, logp, probs = sample_with_probs(logits, params, step_noise, full_probs=features)
            if phi is not None:  # the tokens of the rows running before this step are theirs (eos included)
                _add_bias_features(phi, slot_row, running, tokens, probs)
            out[slot_row[running], t] = tokens[running]
            out_logp[slot_row, t] = logp  # finished slots write past their eos, which is cut off
            running &= ~torch.isin(tokens, eos)
            live = int(running.sum())
            if live == 0 or t == steps - 1:
                break
            kept = dec.keep_slots(running, live)
            if kept is not None:
                keep = dec.compact(kept)
                slot_row, tokens, pos, running = slot_row[keep], tokens[keep], pos[keep], running[keep]
                plan = noise.plan(slot_row + first_row) if sampled else None
            logits = dec.decode(tokens, pos, width + t)
            pos = pos + 1
        return out, out_logp, recorded, phi

    def _decoder(self, rows: int, total_len: int) -> _Decoder:
        """A decoder for a batch of ``rows`` rows and ``total_len`` columns: a new dynamic one, or the kept
        static one when it fits (its weights refreshed in place), else a new static one (kept)."""
        if not self.static:
            return _Decoder(self.model, total_len, self.device, prepack=self.prepack)
        if self._static is not None and self._static.fits(rows, total_len):
            self._static.refresh(self.model)
            return self._static
        from meshrl.rollout.static_decode import StaticDecoder

        self._static = None  # free the old buffers (and graphs) before allocating the new ones
        self._static = StaticDecoder(self.model, rows, total_len, self.device,
                                     capture=self.capture_graphs)
        return self._static

    def _shards(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Split rows ``[start, stop)`` into contiguous ``(first, end)`` ranges, one per decoder, cut at
        multiples of 16 rows (whole GRPO groups when G divides 16), so that shards rarely share a prompt."""
        block = 16
        n_blocks = -(-(stop - start) // block)
        k = max(1, min(self.workers, n_blocks))
        cuts = [start + block * (n_blocks * i // k) for i in range(k)] + [stop]
        return [(a, min(b, stop)) for a, b in zip(cuts, cuts[1:], strict=False) if a < min(b, stop)]

    def _decode_shard(self, prompts: list[list[int]], params: SamplingParams, seed: int, first_row: int,
                      vocab: int, features: bool = False
                      ) -> tuple[list[list[int]], list[list[float]], np.ndarray | None]:
        """Token rows of one shard, their log-probs and (``features``) their MEI features ``[rows, V]``; runs
        here or in a pool worker (hence eval mode and the thread-local contexts, and plain lists and a numpy
        array, which cross the pipe without shared-memory tensor handles)."""
        self.model.eval()
        with torch.inference_mode(), self._autocast():
            noise = RowNoise(seed, vocab, self.device)
            tokens, logps, _, phi = self._decode_batch(prompts, params, noise=noise, first_row=first_row,
                                                       stop_at_eos=not params.ignore_eos, features=features)
            return tokens.tolist(), logps.tolist(), None if phi is None else phi.cpu().numpy()

    def _decoders(self, n_shards: int):
        """The pool for ``n_shards`` shards (started or restarted on demand), or None to decode here."""
        if n_shards < 2:
            return None
        if self._pool is not None and (self._pool.closed or not self._pool.serves(self.model)
                                       or self._pool.size < n_shards):
            self.close()
        if self._pool is None:
            try:  # as many processes as this call has shards (a 64-row step on a 64-core box needs 4)
                self._pool = ForkPool(self.model, self._decode_shard, n_shards, name="decode")
            except (OSError, RuntimeError) as err:  # no fork, no shared memory (e.g. a tiny /dev/shm)
                log.warning("native decode: no worker processes (%s); decoding on one core", err)
                self.workers = 1
                return None
        return self._pool

    def release_workers(self) -> None:
        """End the worker processes and drop the static decoder's buffers and graphs now; the next
        :meth:`generate` forks and builds them again (``rollout.keep_decoders``: a trainer's update then does not
        hold their pages or its KV cache)."""
        self.close()
        self._static = None

    def close(self) -> None:
        """Stop the worker processes (also done when the backend is garbage-collected or at exit)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, seed: int,
                 features: bool = False) -> Rollouts:
        jobs = self._jobs(prompt_ids, params.n)
        if not self._verified and jobs:
            distinct = distinct_prompts(list(prompt_ids))[0][:3]
            self.verify(distinct + distinct[:1])  # a repeated prompt exercises the shared prefill
        step = self.batch_size or max(len(jobs), 1)
        vocab = base_model(self.model).lm_head.out_features
        result = Rollouts(engine_logprobs=[], engine_features=[] if features else None)
        with eval_mode(self.model):
            for start in range(0, len(jobs), step):
                stop = min(start + step, len(jobs))
                shards = [([p for _, p in jobs[a:b]], params, seed, a, vocab, features)
                          for a, b in self._shards(start, stop)]
                pool = self._decoders(len(shards))
                outputs = None
                if pool is not None:
                    try:
                        outputs = pool.map(self._decode_shard, shards)
                    except WorkerDied as err:  # killed (e.g. out of memory): decode this batch here instead
                        log.warning("native decode: %s; decoding this batch in one process", err)
                if outputs is None:
                    outputs = [self._decode_shard(*args) for args in shards]
                self._append(result, jobs[start:stop], [row for rows, _, _ in outputs for row in rows],
                             [row for _, lps, _ in outputs for row in lps],
                             np.concatenate([phi for _, _, phi in outputs]) if features else None,
                             ignore_eos=params.ignore_eos)
        return self._finish(result)


def probe_prompts(tokenizer) -> list[list[int]]:
    """Two prompts of different lengths (so that left padding is exercised) for :meth:`verify`."""
    ids = tokenizer.encode("Hello! What is 12 + 30? Answer:", add_special_tokens=False) or [0, 1, 2, 3]
    return [ids, ids[: max(1, len(ids) // 2)]]
