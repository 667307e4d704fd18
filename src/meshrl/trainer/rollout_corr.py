"""The training-inference mismatch: a per-step diagnostic and ``plugins.rollout_corr`` (docs/plugins.md).

The rollout backend returns its own log-prob of every sampled token (``Rollouts.engine_logprobs``: the
tempered distribution ``log softmax(logits / T)[y]`` before the top-p cut, in the backend's precision); the
update scores the same tokens with the training forward. Their difference is the mismatch of Yao et al.
2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"): nonzero whenever the two
forwards differ in precision or kernels (a bf16 sampler, vLLM), so that "on-policy" training is in fact
slightly off-policy.

- :class:`MismatchMonitor` collects, per step, the update's log-probs of the old policy the first time each row
  passes through the loss (``pi_old``: the first epoch's forward, or the precomputed old log-probs; no extra
  forward) and logs ``mismatch/*`` (:func:`meshrl.algos.logprob_mismatch_stats`) against the sampler's.
- :func:`rollout_correction` is the plug-in's loss term: the per-token policy loss times the detached weights
  ``w = pi_old_train / pi_rollout`` (truncated, TIS, or masked outside ``[lo, hi]``, IcePop), with the tokens
  or sequences a k1/k2/k3 test rejects masked out (:func:`meshrl.algos.rollout_is_weights`,
  :func:`meshrl.algos.rollout_rejection_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import logprob_mismatch_stats, rollout_is_weights, rollout_rejection_mask

REJECT_STATS = ("none", "k1", "k2", "k3")


@dataclass
class RolloutCorrConfig:
    enabled: bool = False
    level: str = "token"  # token | sequence: one weight per token, or the product over the response
    mode: str = "truncate"  # truncate: w <- min(w, threshold) (TIS); mask: w <- 0 outside [lo, hi] (IcePop)
    threshold: float = 2.0  # C of truncate
    lo: float = 0.5  # the kept band of mask
    hi: float = 2.0
    reject: str = "none"  # none | k1 | k2 | k3: mask tokens (token level) or rows (sequence level, row mean)
    reject_threshold: float = 0.0  # k2/k3: reject above it; k1: keep |log w| <= log(reject_threshold) (> 1)


def rollout_corr_checks(c: RolloutCorrConfig) -> dict[str, bool]:
    """``plugins.rollout_corr.*`` key -> whether its value is valid (for ``validate_plugins``)."""
    k1 = c.reject == "k1"
    return {
        "plugins.rollout_corr.level": c.level in ("token", "sequence"),
        "plugins.rollout_corr.mode": c.mode in ("truncate", "mask"),
        "plugins.rollout_corr.threshold": c.threshold > 0,
        "plugins.rollout_corr.lo": c.lo > 0,
        "plugins.rollout_corr.hi": c.lo <= c.hi,
        "plugins.rollout_corr.reject": c.reject in REJECT_STATS,
        "plugins.rollout_corr.reject_threshold": (c.reject == "none" or c.reject_threshold > (1 if k1 else 0)),
    }


def rows_tensor(rows: list[list[float] | None], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [n, T], has [n])``: the rows right-padded with 0 into ``like``'s shape, and which rows have
    values (a None row is all 0 and ``has`` False)."""
    out = torch.zeros_like(like)
    has = torch.zeros(like.shape[0], dtype=torch.bool, device=like.device)
    for i, r in enumerate(rows):
        if r is not None:
            n = min(len(r), like.shape[1])
            out[i, :n] = torch.tensor(r[:n], dtype=like.dtype)
            has[i] = True
    return out, has


def rollout_correction(c: RolloutCorrConfig, pg_mat: torch.Tensor, agg_mask: torch.Tensor, old: torch.Tensor,
                       rollout: torch.Tensor, has: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(pg_mat * w * keep, agg_mask * keep, metrics)`` for a micro-batch ``[n, T]``.

    ``w = pi_old / pi_rollout`` from the update's old log-probs ``old`` and the sampler's ``rollout`` (rows with
    ``has`` False, e.g. off-policy traces, keep weight 1 and are never rejected); ``keep`` 0 on the rejected
    tokens (``reject=k*``; a whole row at sequence level, tested on the row mean of the estimator). Metrics:
    ``rollout_corr/weight_mean`` (mean weight over the valid tokens with a rollout log-prob),
    ``rollout_corr/frac_truncated`` (share of those whose weight was truncated or zeroed) and
    ``rollout_corr/frac_rejected``.
    """
    valid = mask * has[:, None].to(mask.dtype)
    if c.mode == "truncate":
        w, s = rollout_is_weights(old, rollout, valid, level=c.level, mode="truncate", upper=c.threshold)
    else:
        w, s = rollout_is_weights(old, rollout, valid, level=c.level, mode="mask", upper=c.hi, lower=c.lo)
    keep = torch.ones_like(valid)
    rejected = 0.0
    if c.reject != "none":
        stat = f"token_{c.reject}" if c.level == "token" else f"seq_mean_{c.reject}"
        lower = 1.0 / c.reject_threshold if c.reject == "k1" else None
        kept, rs = rollout_rejection_mask(old, rollout, valid, stat=stat, upper=c.reject_threshold, lower=lower)
        keep = torch.where(valid > 0, kept, keep)
        rejected = rs["rollout_rs/masked_frac"]
    weight = torch.where(valid > 0, w, torch.ones_like(w)).to(pg_mat.dtype)
    n = valid.sum()
    stats = {"rollout_corr/weight_mean": float((w * valid).sum() / n) if n > 0 else 1.0,
             "rollout_corr/frac_truncated": s["rollout_is/clipped_frac"] if n > 0 else 0.0,
             "rollout_corr/frac_rejected": rejected}
    keep = keep.to(pg_mat.dtype)
    return pg_mat * weight * keep, agg_mask * keep, stats


class MismatchMonitor:
    """Per step: the sampler's log-probs against the update's ``pi_old`` on the same tokens (module docstring).

    :meth:`begin` at sampling, :meth:`observe` from the loss of every micro-batch (only a row's first pass
    counts), :meth:`finish` after the update. ``skip`` rows (off-policy traces) are left out."""

    def __init__(self) -> None:
        self.rollout: list[list[float] | None] = []
        self.skip: set[int] = set()
        self.old: dict[int, torch.Tensor] = {}
        self.announced = False

    def begin(self, data: Any, skip: set[int]) -> None:
        self.rollout = list(getattr(data, "rollout_logps", []) or [])
        self.skip = set(skip)
        self.old = {}

    def rows(self, idx: list[int]) -> list[list[float] | None]:
        """The sampler's log-probs of step rows ``idx`` (None where a row has none or is skipped)."""
        return [self.rollout[j] if j < len(self.rollout) and j not in self.skip else None for j in idx]

    def observe(self, idx: list[int], old: torch.Tensor, mask: torch.Tensor) -> None:
        """Keep ``old [n, T]`` of each row of ``idx`` the first time the row is seen this step."""
        lengths = mask.sum(-1).long().tolist()
        for k, j in enumerate(idx):
            if j not in self.old:
                self.old[j] = old[k, : lengths[k]].detach().float().cpu()

    def finish(self) -> dict[str, float]:
        """``mismatch/*`` over every observed row with sampler log-probs of the same length ({} when none)."""
        idx = list(range(len(self.rollout)))
        pairs = [(self.old[j], r) for j, r in zip(idx, self.rows(idx), strict=True)
                 if r is not None and j in self.old and len(r) == self.old[j].shape[0] and len(r) > 0]
        if not pairs:
            return {}
        width = max(len(r) for _, r in pairs)
        old = torch.zeros(len(pairs), width)
        mask = torch.zeros(len(pairs), width)
        for i, (o, _) in enumerate(pairs):
            old[i, : o.shape[0]], mask[i, : o.shape[0]] = o, 1.0
        rollout, _ = rows_tensor([r for _, r in pairs], old)
        return logprob_mismatch_stats(old, rollout, mask)

    def setup_event(self, trainer: Any) -> dict[str, Any] | None:
        """Once per run: an ``events.jsonl`` record naming the backend and the two precisions compared."""
        if self.announced:
            return None
        self.announced = True
        backend = trainer.backend
        weights = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
        rollout = f"autocast-{backend.autocast}" if getattr(backend, "autocast", None) else weights
        if backend.name == "vllm":
            rollout = str(getattr(backend, "llm_kwargs", {}).get("dtype", "unknown"))
        update = "autocast-bfloat16" if trainer.cfg.train.autocast_bf16 else weights
        return {"step": trainer.step_idx + 1, "event": "mismatch_setup", "backend": backend.name,
                "rollout_precision": rollout, "update_precision": update}
