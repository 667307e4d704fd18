"""``plugins.estr``: the entropy-scaled trust region of Zhao, Xie, Zheng, Gong, Lu, Yang, Hu, Chen 2026,
"Deconstructing Off-Policy Ratios: Entropy-Scaled Trust Regions for Asynchronous Reinforcement Learning",
arXiv 2607.22186.

The natural scale of a stale token's log-ratio grows with the behaviour policy's entropy there
(``E[delta_t^2] ~ H_t``): a fixed ratio band keeps the amplified noise of low-entropy tokens and drops the
legitimate moves of high-entropy ones. ESTR keeps a token in the policy gradient when its log-ratio, standardised
by the local entropy, is inside the trust region:

    delta_t = log pi_theta(y_t) - log mu(y_t)          (mu: the policy that sampled the token)
    H_t     = -sum_w mu(w) log mu(w)                   (mu's entropy at the token, at the sampling temperature)
    S_t     = delta_t^2 / (H_t + eps),   M_t = [S_t <= tau]     i.e. |delta_t| <= sqrt(tau (H_t + eps))
    loss    = the recipe's per-token loss (its PPO clip) times M_t, normalised over every valid token

(the paper's objective ``L_ESTR``: the mask multiplies the clipped surrogate, the normaliser ``sum_i |o_i|`` keeps
the masked tokens). ``eps`` = 0.01 as in the paper. The paper's value of ``tau`` was not in the sources read for
this plug-in, so ``tau`` has no default: it must be set (a run with it unset is refused naming the key).

``mu``'s entropy: for a batch ``plugins.replay`` reuses, the entropy of the policy that sampled it, taken at the
start of the batch's first update (before any optimiser step: the same policy whose log-probs the ratio is taken
against) and kept, with the checkpoint, while the batch is reused. With several optimiser steps on a fresh batch
(``train.ppo_epochs``, ``train.mini_batches``) ``mu`` is the update's start policy. Either costs one no-grad
forward per fresh batch. With one optimiser step per batch and no replay the ratio is exactly 1, ``S_t = 0`` and
the plug-in changes nothing; it is made for stale rollouts (``plugins.replay.reuse_steps > 0``).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, TokenTerms, register

log = logging.getLogger("meshrl")


@dataclass
class EstrConfig:
    enabled: bool = setting(False, help="mask tokens whose log-ratio is large for their entropy (ESTR)")
    tau: float = setting(0.0, ge=0, help="tau: a token is kept when delta^2 / (H + eps) <= tau; no published "
                         "default was found: must be set > 0 when enabled")
    eps: float = setting(0.01, gt=0, help="entropy floor eps of the trust region (the paper: 0.01)")


def estr_keep(logp: torch.Tensor, old: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, *, tau: float,
              eps: float) -> tuple[torch.Tensor, Stats]:
    """ESTR's keep mask ``[n, T]`` (1 inside the trust region) and its metrics over the valid tokens."""
    valid = mask.bool()
    delta = logp.detach() - old
    score = delta.square() / (entropy + eps)
    keep = score <= tau
    n = max(int(valid.sum()), 1)
    stats = {"estr/masked_frac": float((valid & ~keep).sum()) / n,
             "estr/score_mean": float((score * valid).sum()) / n,
             "estr/entropy_mean": float((entropy * valid).sum()) / n}
    return keep.to(logp.dtype), stats


def _batch_key(data: Any) -> str:
    """A content key of a batch's token ids: a reused batch is recognised, after a resume too."""
    h = hashlib.sha256()
    for prompt, response in zip(data.prompt_ids, data.response_ids, strict=True):
        h.update(repr((list(prompt), list(response))).encode())
    return h.hexdigest()


@register
class Estr(Plugin):
    name = "estr"
    Config = EstrConfig
    stage = Stage.TOKEN_SELECTION
    order = 2.5
    # remix and luffy bring rows sampled by other policies, whose entropies are not the start policy's
    excludes = ("remix", "luffy")
    summary = "ESTR: entropy-scaled trust region for stale rollouts (Zhao et al. 2026)"
    lag_refusal = ("ESTR needs the sampling policy's entropy at each token, which the lagged sampler does not "
                   "record; use rollout.staleness_correction=tis or m2po")

    def __init__(self, cfg: EstrConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self.key: str | None = None  # the batch whose behaviour entropies are kept
        self.entropy: list[torch.Tensor] | None = None  # per row [T_i]; None: use the update's own entropy

    @classmethod
    def check(cls, cfg: EstrConfig, run_cfg: Any) -> None:
        if cfg.enabled and cfg.tau <= 0:
            raise ValueError("plugins.estr.tau must be set > 0 when plugins.estr.enabled (no default: see "
                             "docs/plugins.md)")

    def _needs_behaviour_entropy(self) -> bool:
        """False only when the update's own entropy is mu's at every token: one optimiser step, no replay."""
        cfg = self.ctx.cfg
        single_pass = cfg.train.ppo_epochs == 1 and cfg.train.mini_batches == 1
        return not single_pass or cfg.plugins.replay.reuse_steps > 0

    @torch.no_grad()
    def _start_entropy(self, data: Any) -> list[torch.Tensor]:
        fwd = self.ctx.forward
        out: list[torch.Tensor] = [torch.empty(0)] * len(data)
        for idx, mb in fwd.micro_batches(list(range(len(data))), data):
            _, entropy = fwd.response_terms(mb)
            for k, j in enumerate(idx):
                out[j] = entropy[k, : len(data.response_ids[j])].float().cpu()
        return out

    def begin_update(self, data: Any, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> Stats:
        if not self._needs_behaviour_entropy():
            self.key, self.entropy = None, None
            return {}
        key = _batch_key(data)
        if key == self.key:
            return {}
        if data.stats.get("replay/age", 0.0) > 0:  # a reused batch whose sampler's entropies were not kept
            log.warning("plugins.estr: no behaviour entropies kept for this reused batch; using the current "
                        "policy's (estr/entropy_recomputed)")
            self.key, self.entropy = key, self._start_entropy(data)
            return {"estr/entropy_recomputed": 1.0}
        self.key, self.entropy = key, self._start_entropy(data)
        return {}

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        entropy = terms.entropy if self.entropy is None else _pad(self.entropy, terms.rows, terms.logp)
        keep, stats = estr_keep(terms.logp, terms.old, entropy, terms.mask, tau=self.cfg.tau, eps=self.cfg.eps)
        return pg_mat * keep, agg_mask, stats  # the normaliser keeps the masked tokens (the paper's L_ESTR)

    def state_dict(self) -> dict[str, Any] | None:
        # only a batch that replay reuses after a resume needs them (else every checkpoint would carry the whole
        # batch's entropies); float32 values are float64 exactly, and JSON writes the shortest text that reads back
        if self.entropy is None or self.ctx.cfg.plugins.replay.reuse_steps == 0:
            return {"key": None, "entropy": None}
        rows = [row.tolist() for row in self.entropy]
        return {"key": self.key, "entropy": rows}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        rows = (state or {}).get("entropy")
        self.key = (state or {}).get("key") if rows is not None else None
        self.entropy = None if rows is None else [torch.tensor(r, dtype=torch.float32) for r in rows]


def _pad(rows: list[torch.Tensor], idx: list[int], like: torch.Tensor) -> torch.Tensor:
    """``[n, T]`` of the rows ``idx`` of ``rows``, zero-padded to ``like``'s length."""
    out = torch.zeros(len(idx), like.shape[1], dtype=like.dtype, device=like.device)
    for k, j in enumerate(idx):
        row = rows[j][: like.shape[1]]
        out[k, : len(row)] = row.to(like)
    return out
