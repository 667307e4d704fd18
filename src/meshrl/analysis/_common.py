"""Shared plumbing of the offline analyses: policy loading, progress bars, forward passes, JSONL input."""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from meshrl.jsonl import iter_jsonl
from meshrl.progress import progress_bar  # noqa: F401  (re-exported for the analysis modules)
from meshrl.trainer import MicroBatch, collate, response_logits, token_logprobs

log = logging.getLogger("meshrl")

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; anything else is passed to ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None


def load_for_analysis(model_spec: str, *, seed: int = 0, device: str = "auto") -> tuple[Any, Any, str]:
    """``(model, tokenizer, description)`` via :func:`meshrl.trainer.load_policy`, in eval mode.

    ``model_spec`` is a model spec (``tiny``, ``smollm2-135m``, a local HF directory), a meshrl run
    directory (its latest checkpoint) or ``RUN_DIR/checkpoints/step_N``.
    """
    from meshrl.trainer import load_policy

    model, tok, desc = load_policy(str(model_spec), seed=seed)
    model = model.to(resolve_device(device)).eval()
    return model, tok, desc


def pad_id_of(tok: Any, eos: Sequence[int]) -> int:
    """The tokenizer's pad id, else the first eos id (padding is masked out, so any id works)."""
    return int(tok.pad_token_id) if tok.pad_token_id is not None else int(eos[0])


def forward_response(
    model: torch.nn.Module, mb: MicroBatch, *, hidden: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 logits ``[n, T, V]`` predicting the response tokens and, with ``hidden``, the final hidden
    states ``[n, T, D]`` at the same positions (the input of the unembedding, ``logits_t = h_t W^T``).

    Without ``hidden`` this is :func:`meshrl.trainer.batch.response_logits` in its one-pass form (real
    logits at every position, padding included, as with ``hidden``). With it, the model is called the same
    way plus ``output_hidden_states=True`` and ``hidden_states[-1]`` (after the final norm in Hugging Face
    causal LMs) is sliced exactly as ``response_logits`` slices the logits.
    """
    if not hidden:
        return response_logits(model, mb, share_prompts=False), None
    device = next(model.parameters()).device
    out = model(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                position_ids=mb.position_ids.to(device), use_cache=False, output_hidden_states=True)
    t = mb.response_ids.shape[1]
    sl = slice(mb.prompt_len - 1, mb.prompt_len - 1 + t)
    logits, h = out.logits[:, sl].float(), out.hidden_states[-1][:, sl].float()
    _check_head(model, h, logits)
    return logits, h


def _check_head(model: torch.nn.Module, h: torch.Tensor, logits: torch.Tensor) -> None:
    """Warn once per call site when ``logits != h W^T`` (then the ``head`` map is not the exact gradient)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or getattr(head, "bias", None) is not None:
        return
    approx = h[:, :2] @ weight.float().T
    if approx.shape == logits[:, :2].shape and not torch.allclose(approx, logits[:, :2], atol=1e-3, rtol=1e-3):
        log.warning("final hidden state times the output embedding does not reproduce the logits (softcapping or "
                    "scaling?): the 'head' feature is then not the exact unembedding gradient")


def sequence_logprobs(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                      temperature: float = 1.0, model_masks: list[list[int] | None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, n_tokens)``, each ``[n]``: ``sum_t log softmax(logits_t / T)[y_t]`` over each response (over the
    model's own tokens where ``model_masks`` marks them: a tool's output in an episode is context, not sampled).

    Uses :func:`collate` / :func:`response_logits` / :func:`token_logprobs` (temperature 0 counts as 1).
    """
    mb = collate(prompts, responses, pad_id, model_masks)
    with torch.no_grad():
        lp = token_logprobs(response_logits(model, mb), mb.response_ids, temperature)
    mask = mb.response_mask.to(lp.device)
    return (lp * mask).sum(-1).double().cpu(), mask.sum(-1).cpu()


def finite_stats(values: Sequence[float], ddof: int = 1) -> tuple[float, float, int]:
    """``(mean, std, n)`` of the finite values; std with ``ddof`` (NaN when ``n <= ddof``)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(vals)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - ddof)) if n > ddof else math.nan
    return mean, std, n


def nan_to_none(x: Any) -> Any:
    """Recursively replace non-finite floats by ``None`` so that the result is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [nan_to_none(v) for v in x]
    return x


def read_jsonl_rows(path: str | Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """``[(line number, record)]`` of a JSONL file; blank lines are skipped.

    Raises ``ValueError`` naming the file (and line) when the file is missing, a line is not valid JSON
    or not a JSON object.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {p}: no such file")
    return list(iter_jsonl(p, what=what, partial_last="raise"))


def expand_param_names(model: torch.nn.Module, patterns: Sequence[str] | str | None) -> list[str] | None:
    """Parameter names selected by exact names or ``fnmatch`` globs (``model.layers.1.*``), in
    ``named_parameters()`` order; ``None`` stays ``None`` (every trainable parameter).

    A name of a tied parameter (``lm_head.weight`` tied to ``model.embed_tokens.weight``) selects the
    parameter under its canonical name, the one ``named_parameters()`` lists.
    """
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = [s for s in patterns.split(",") if s.strip()]
    names = [n for n, _ in model.named_parameters()]
    canonical = {id(p): n for n, p in model.named_parameters()}
    alias = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    chosen: set[str] = set()
    for pat in patterns:
        pat = pat.strip()
        hits = [alias[n] for n in alias if n == pat or fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise ValueError(f"params: {pat!r} matches no parameter of the model (e.g. {', '.join(names[:3])})")
        chosen.update(hits)
    return [n for n in names if n in chosen]
