"""Llama-family decoder blocks run by meshrl itself, on the model's own parameters.

Used by the ``native`` rollout backend (KV-cached decoding; the trainer's update keeps the model's own
forward, which measured as fast on tiny:small and 12% faster on SmolLM2-135M). The math
is Hugging Face's Llama (pre-norm RMSNorm, rotate-half RoPE, grouped-query attention, SiLU-gated MLP,
optional q/k/v biases as in Qwen2 and per-head q/k RMSNorm as in Qwen3), checked against each model's
own forward in the tests. Two ways to run a block:

* **packed** (plain ``nn.Linear`` layers): q|k|v and gate|up concatenated into one weight each, and
  ``F.rms_norm``: fewer, larger ops (a decode step of a small model costs its op count more than its FLOPs).
* **modules** (anything else, e.g. peft LoRA layers): each submodule is called as the model would.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from meshrl import cpu
from meshrl.models.lora import base_model

log = logging.getLogger("meshrl")

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # frequencies independent of the sequence length
# Few rows against a vocabulary at least this large: compute the head as W @ h^T (see LlamaRunner.logits).
LARGE_VOCAB = 8192
# Prepacked GEMMs (PrepackedGemm) from this hidden size on: below it a decode step costs its op count, and oneDNN's
# call costs more than F.linear's (tiny:small, hidden 128: 16% slower at 16 rows; tiny:medium, 256: 1.2-1.3x
# faster; SmolLM2-135M, 576: 1.4-1.7x; benchmarks/README.md, "Prepacked decode GEMMs").
PREPACK_MIN_HIDDEN = 256


def unsupported_reason(model) -> str | None:
    """Why meshrl cannot run ``model``'s blocks itself (None when it can)."""
    lm = base_model(model)
    cfg = getattr(lm, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_TYPES:
        return f"model_type {mtype!r} is not one of {SUPPORTED_TYPES}"
    inner = getattr(lm, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or any(not hasattr(inner, a) for a in needed) or not hasattr(lm, "lm_head"):
        return f"{type(lm).__name__} lacks the Llama module layout (model.embed_tokens/layers/norm/rotary_emb, lm_head)"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}: only full attention is implemented"
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if mtype in ("mistral", "qwen2") and window:
        return f"sliding-window attention (window {cfg.sliding_window}) is not implemented"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE:
        # dynamic / longrope pick their frequencies from the longest position in use: one table per batch
        # would not be the table the trainer's forward uses.
        return f"rope type {rope_type!r} is not one of the static types {STATIC_ROPE}"
    attn = inner.layers[0].self_attn
    if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
        return f"{type(attn).__name__} lacks q/k/v/o projections, head_dim or scaling"
    return None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al. 2021, RoFormer) in the rotate-half convention of Hugging Face Llama:
    ``x cos + rotate_half(x) sin`` with ``rotate_half([a, b]) = [-b, a]`` over the two halves of ``d``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rms_eps(norm) -> float | None:
    """The epsilon of an RMSNorm module (Hugging Face's ``variance_epsilon`` or torch's ``eps``)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if eps is not None else None


def packable(lm) -> bool:
    """True when every block is plain ``nn.Linear`` / RMSNorm / SiLU-gated MLP, so that the decoder may run
    fused weights (q|k|v and gate|up in one matmul each) instead of calling the modules one by one."""
    if getattr(lm.config, "hidden_act", None) not in ("silu", "swish"):
        return False
    for layer in lm.model.layers:
        a, m = layer.self_attn, layer.mlp
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj] + [getattr(m, n, None) for n in ("gate_proj", "up_proj",
                                                                                           "down_proj")]
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + [getattr(a, n) for n in ("q_norm", "k_norm")
                                                                          if hasattr(a, n)]
        if any(type(x) is not torch.nn.Linear for x in linears) or any(rms_eps(x) is None for x in norms):
            return False
    return rms_eps(lm.model.norm) is not None


def _cat_bias(linears, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """The biases of ``linears`` concatenated as their weights are (zeros for a layer without one), cast to
    ``dtype`` when given, or None when none has a bias."""
    if all(lin.bias is None for lin in linears):
        return None
    return _fused([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
                   for lin in linears], dtype)


def autocast_dtype(device: torch.device, weight_dtype: torch.dtype) -> torch.dtype | None:
    """The lower dtype autocast casts ``weight_dtype`` matmul operands to on ``device`` right now, else None."""
    if not torch.is_autocast_enabled(device.type) or not weight_dtype.is_floating_point:
        return None
    low = torch.get_autocast_dtype(device.type)
    return low if low.itemsize < weight_dtype.itemsize else None


def _fused(parts: list[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    """``parts`` concatenated along dim 0, cast to ``dtype`` when given."""
    out = torch.cat(parts)
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


class Gemm:
    """``x @ weight^T (+ bias)`` for one (fused) weight, through ``F.linear``: the plain path."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight^T (+ bias)`` as one GEMM that accumulates into ``residual`` (a residual
        connection). Under autocast ``addmm`` would return the residual stream in the low dtype, which the
        model's own forward keeps in its weights' dtype, so the sum is then taken apart."""
        if torch.is_autocast_enabled(residual.device.type):
            return residual + self(x)
        b = self.bias
        return torch.addmm(residual if b is None else residual + b, x.reshape(-1, x.shape[-1]),
                           self.weight.t()).view(residual.shape)


def prepack_available(device: torch.device) -> bool:
    """True where :class:`PrepackedGemm` runs: a CPU with oneDNN (torch's mkldnn ops)."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


_said_fallback = False


def prepacked_dtype(low: torch.dtype | None) -> torch.dtype | None:
    """The dtype of the prepacked copies for autocast's ``low`` dtype: ``low`` itself, except bf16 on a CPU where
    oneDNN has no bf16 kernels (:func:`meshrl.cpu.bf16_gemm_native`: AVX2 without AVX-512), whose reorder refuses
    bf16 weights. There the copies stay float32 (None): on SmolLM2-135M's decode shapes at 16 rows, with PyTorch's
    AVX2 kernels, a float32 prepacked GEMM ran 3-5x faster than bf16 ``F.linear``, which emulates bf16 there
    (benchmarks/README.md, "CPUs without native bf16"). The choice is logged once, with its reason."""
    global _said_fallback
    if low != torch.bfloat16 or cpu.bf16_gemm_native():
        return low
    if not _said_fallback:
        _said_fallback = True
        log.info("native decoder: prepacked GEMMs in float32 under bf16 autocast: this CPU (PyTorch capability "
                 "%s) has no oneDNN bf16 kernels (they need AVX-512 BW/VL/DQ or AVX-NE-CONVERT), and float32 "
                 "prepacked GEMMs measured 3-5x faster than emulated bf16 ones", cpu.capability())
    return None


class PrepackedGemm(Gemm):
    """:class:`Gemm` on a copy of the weight reordered once into oneDNN's blocked layout (inference only).

    Why: a decode step multiplies a few rows by every weight, which is bound by reading the weights; oneDNN's
    inner product on a prepacked weight reads them in the order its kernel wants. On SmolLM2-135M's shapes
    (2 threads, 16 rows, float32) a decode step's GEMMs took 27 ms instead of 50 ms (head included, whose
    ``W @ h^T`` form it also beats: 8 ms against 17 ms); benchmarks/README.md, "Prepacked decode GEMMs". The
    same computation, rounded differently in float32 (oneDNN's blocking, not MKL's: ~1e-6 relative), and in
    bfloat16 bit for bit ``F.linear`` (which already runs oneDNN there, on the unpacked weight). The input is cast
    to the weight's dtype, as autocast would cast it (autocast does not see this op). The copy is taken from the
    weight at construction: build one per batch, after the optimiser's step, as :class:`PackedBlock` is."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.dtype = weight.dtype
        bias = None if bias is None else bias.detach().to(weight.dtype)
        super().__init__(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.weight, self.bias, "none", [], "")

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if residual.dtype != self.dtype:  # autocast: a low-precision GEMM into the weights'-dtype stream
            return residual + self(x)
        return torch.ops.mkldnn._linear_pointwise.binary(x.to(self.dtype), residual, self.weight, self.bias, "add")


class PackedBlock:
    """Fused weights of one block, taken from the current parameters (gradients flow back to them unless
    ``prepack``).

    ``dtype``: store the fused copies in this dtype, the one autocast would cast them to at every call (a fused
    weight is not a parameter, so autocast's per-region cast cache does not hold it). The matmuls see exactly
    the values they saw before, the copies take half the memory, and no cast runs per decode step.
    ``prepack``: run every projection as a :class:`PrepackedGemm` (decoding without gradients on a CPU).
    ``cast_all``: the unfused ``o`` and ``down`` weights in ``dtype`` too (copies; by default they are the
    parameters, cast by autocast at each call), as the prepacked ones are."""

    def __init__(self, layer, dtype: torch.dtype | None = None, prepack: bool = False, cast_all: bool = False):
        a, m = layer.self_attn, layer.mlp
        gemm = PrepackedGemm if prepack else Gemm
        low = dtype if prepack or cast_all else None  # the unfused o / down weights: autocast's dtype, copied
        self.qkv = gemm(_fused([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], dtype),
                        _cat_bias([a.q_proj, a.k_proj, a.v_proj], dtype))  # qwen2: q/k/v biases
        self.o = gemm(_cast(a.o_proj.weight, low), _cast(a.o_proj.bias, low))
        self.gate_up = gemm(_fused([m.gate_proj.weight, m.up_proj.weight], dtype),
                            _cat_bias([m.gate_proj, m.up_proj], dtype))  # llama with mlp_bias=True
        self.down = gemm(_cast(m.down_proj.weight, low), _cast(m.down_proj.bias, low))
        self.norm1 = (layer.input_layernorm.weight, rms_eps(layer.input_layernorm))
        self.norm2 = (layer.post_attention_layernorm.weight, rms_eps(layer.post_attention_layernorm))
        self.q_norm = (a.q_norm.weight, rms_eps(a.q_norm)) if hasattr(a, "q_norm") else None
        self.k_norm = (a.k_norm.weight, rms_eps(a.k_norm)) if hasattr(a, "k_norm") else None


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


def rms(x: torch.Tensor, weight_eps: tuple[torch.Tensor, float]) -> torch.Tensor:
    """RMSNorm over the last dimension, ``x / sqrt(mean(x^2) + eps) * weight`` (Zhang & Sennrich 2019)."""
    weight, eps = weight_eps
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class LlamaRunner:
    """Blocks of a supported model (see :func:`unsupported_reason`) with RoPE tables for ``max_len``
    positions. Build one per batch: packed weights are taken from the parameters at construction (in autocast's
    dtype when it is active then: build and run the runner inside the same autocast region). ``prepack``: run
    the projections and the head as :class:`PrepackedGemm` (a decoder without gradients on a CPU; ignored where
    oneDNN is missing, the blocks are not packable or the model is below :data:`PREPACK_MIN_HIDDEN`)."""

    def __init__(self, model, max_len: int, device: torch.device, prepack: bool = False):
        lm = base_model(model)
        self.inner, self.head = lm.model, lm.lm_head
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim, self.scale = int(attn.head_dim), float(attn.scaling)
        cfg = lm.config
        self.n_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        positions = torch.arange(max_len, device=device)[None]
        probe = torch.zeros(1, device=device, dtype=next(lm.parameters()).dtype)
        cos, sin = self.inner.rotary_emb(probe, positions)  # [1, S, head_dim]
        self.cos, self.sin = cos[0], sin[0]
        # rotate_half(x) = roll(x, d/2) * [-1 (first half), +1 (second half)]: fold the sign into sin.
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)]).to(self.sin)
        self.sin_signed = self.sin * sign
        # Fewer, larger ops per step: a decode step on a small model costs its op count more than its FLOPs.
        low = autocast_dtype(torch.device(device), next(lm.parameters()).dtype)
        plain = packable(lm)
        self.prepacked = (prepack and plain and prepack_available(torch.device(device))
                          and cfg.hidden_size >= PREPACK_MIN_HIDDEN)
        if self.prepacked:
            low = prepacked_dtype(low)
        self.packed = [PackedBlock(layer, low, self.prepacked) for layer in self.layers] if plain else None
        self.head_gemm = (PrepackedGemm(_cast(self.head.weight, low), _cast(self.head.bias, low))
                          if self.prepacked else None)

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, s, 1, d]`` for positions ``pos [n, s]`` (shared by every block of a forward)."""
        return self.cos[pos][:, :, None], self.sin[pos][:, :, None]

    def qkv(self, li: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Rotated q ``[n, H, s, d]`` and k, v ``[n, KV, s, d]`` of block ``li`` for its input ``x [n, s, D]``."""
        n, s, _ = x.shape
        d, heads, kv = self.head_dim, self.n_heads, self.kv_heads
        if self.packed is not None and self.packed[li].q_norm is None:
            pk = self.packed[li]
            qkv = pk.qkv(rms(x, pk.norm1)).view(n, s, heads + 2 * kv, d)
            qk = rotate(qkv[:, :, : heads + kv], *rope)  # q and k heads rotated in one pass
            q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv :]
        elif self.packed is not None:  # qwen3: per-head RMSNorm on q and k before RoPE
            pk = self.packed[li]
            qkv = pk.qkv(rms(x, pk.norm1)).view(n, s, heads + 2 * kv, d)
            q, k, v = qkv.split([heads, kv, kv], dim=2)
            q, k = rotate(rms(q, pk.q_norm), *rope), rotate(rms(k, pk.k_norm), *rope)
        else:
            layer = self.layers[li]
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q, k, v = (proj(h).view(n, s, -1, d) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rotate(q, *rope), rotate(k, *rope)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def block_tail(self, li: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, post-attention norm and MLP of block ``li``; ``attn_out [n, H, s, d]``."""
        n, s = x.shape[:2]
        attn_out = attn_out.transpose(1, 2).reshape(n, s, -1)
        if self.packed is None:
            layer = self.layers[li]
            x = x + layer.self_attn.o_proj(attn_out)
            return x + layer.mlp(layer.post_attention_layernorm(x))
        return self.packed_tail(self.packed[li], x, attn_out)

    @staticmethod
    def packed_tail(pk: PackedBlock, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """:meth:`block_tail` of a packed block, ``attn_out`` already ``[..., H*d]``."""
        x = x + pk.o(attn_out)
        gate, up = pk.gate_up(rms(x, pk.norm2)).chunk(2, dim=-1)
        return x + pk.down(F.silu(gate) * up)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Scaled dot-product attention of q ``[n, H, s, d]`` over k, v ``[n, KV, S, d]`` (kv heads shared
        by ``H / KV`` query heads); ``allowed [n, 1, s, S]`` is True where a query may see a key."""
        group = self.n_heads // self.kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)

    def forward(self, ids: torch.Tensor, key_mask: torch.Tensor, pos: torch.Tensor,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """Final hidden states ``[n, s, D]`` (after the last norm) of tokens ``ids [n, s]`` at positions ``pos``,
        and each block's ``(k, v)`` of these tokens. ``past`` holds keys/values ``[n, KV, P, d]`` of earlier
        tokens; ``key_mask [n, P+s]`` marks the real ones (False = padding). Causal over past + current."""
        n, s = ids.shape
        p = 0 if past is None else past[0][0].shape[2]
        j = torch.arange(p + s, device=ids.device)
        i = torch.arange(s, device=ids.device)[:, None] + p
        # A padding query sees only itself: a fully masked row would give NaN that later layers carry.
        allowed = ((j <= i)[None] & key_mask.bool()[:, None, :]) | (j == i)[None]
        allowed = allowed[:, None]
        x = self.inner.embed_tokens(ids)
        rope = self.rope(pos)
        kvs = []
        for li in range(len(self.layers)):
            q, k, v = self.qkv(li, x, rope)
            kvs.append((k, v))
            if past is not None:
                k, v = torch.cat([past[li][0], k], dim=2), torch.cat([past[li][1], v], dim=2)
            x = self.block_tail(li, x, self.attend(q, k, v, allowed))
        return self.inner.norm(x), kvs

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head applied to final hidden states ``h [..., D]``."""
        if self.head_gemm is not None:
            return self.head_gemm(h)
        w = self.head.weight
        if (h.dim() == 2 and self.packed is not None and self.head.bias is None and w.shape[0] >= LARGE_VOCAB
                and h.shape[0] <= 64):
            # A few rows against a large vocabulary: BLAS threads W @ h^T over the vocabulary but not h @ W^T
            # over the rows (SmolLM2's 49k-token head: 7.8 ms instead of 17.7 ms for 8 rows, 2 threads).
            return torch.mm(w, h.t()).t().contiguous()
        return self.head(h)
