"""``plugins.implicit_value``: VIMPO, the value implied by the policy under KL-regularised RL (Kang, Feng, Levine,
Song, Zhao, "VIMPO: Value-Implicit Policy Optimization for LLMs", 2026, arXiv 2606.20008; reference code
github.com/backprop07/VIMPO, ``recipe/vimpo/vimpo_core_algos.py`` and ``verl/workers/actor/dp_actor.py``, the
``raw`` value type with its defaults: exact KL, detached, PPO actor, whitened advantages, gamma 1, lambda 1).

The optimum of KL-regularised RL with deterministic transitions (generation appends the token) satisfies, per
token, ``beta log pi*/pi_ref (a_t|s_t) = r_t + V(s_{t+1}) - V(s_t) + beta KL(pi*(.|s_t) || pi_ref(.|s_t))``. With
an outcome reward ``R`` at the end, ``V(s_T) = 0`` and the group's mean reward as ``V(s_0)``, summing the token
terms ``tau_t = beta (log pi_theta(a_t|s_t) - log pi_ref(a_t|s_t) - sg[KL_t])`` over a rollout must give its
centred reward. Two terms replace the recipe's advantage-weighted loss:

- the **value loss**, through which the reward enters, ``value_coef * 1/2 * mean_i (sum_t tau_{i,t} -
  (R_i - mean_group R))^2`` over the rows of the mini-batch (its gradient flows through ``log pi_theta``;
  ``KL_t``, exact over the vocabulary at the sampling temperature, is a detached baseline);
- the **actor**: the recipe's policy loss (its clip, its aggregation) with the policy-implied per-token advantage
  ``A_t = sum_{k >= t} lambda^(k-t) sg[tau_k]`` (GAE with zero reward, gamma 1), whitened over the micro-batch's
  valid tokens, times ``actor_coef``. The reward never multiplies the actor's gradient directly.

The reference log-probs and the exact KL are computed once per update at the start parameters (the reference code
recomputes the KL, detached, at each micro-batch; at the batch's first optimiser step, all of it with one epoch and
one mini-batch, the two are equal); ``A_t`` uses each micro-batch's current log-probs, as the reference code does.
The value loss is added as a per-row term (:meth:`Plugin.surrogate`) divided by the mini-batch's row count (the
reference: its mean over a micro-batch times the micro-batch's share of the mini-batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.settings import setting
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, TokenTerms, register

WHITEN_EPS = 1e-8  # verl's masked_whiten


@dataclass
class ImplicitValueConfig:
    enabled: bool = setting(False, help="VIMPO: policy-implied value loss and actor advantages (needs the reference)")
    beta: float = setting(5e-4, gt=0, help="KL-regularisation strength beta of the implied value (VIMPO: 5e-4)")
    actor_coef: float = setting(5e-3, ge=0, help="weight c_A of the actor's policy loss (VIMPO: 5e-3; 0: value only)")
    value_coef: float = setting(1.0, gt=0, help="weight of the value loss (VIMPO: 1)")
    lam: float = setting(1.0, ge=0, le=1, help="GAE lambda of the actor advantage (VIMPO: 1)")
    whiten: bool = setting(True, help="whiten the actor advantages over the micro-batch's valid tokens (VIMPO: true)")


@register
class ImplicitValue(Plugin):
    name = "implicit_value"
    Config = ImplicitValueConfig
    stage = Stage.ADVANTAGE
    order = -1.0  # replaces the advantages: before any plug-in that reshapes them
    # entropy_adv adds an absolute bonus alpha*H to advantages VIMPO scales by actor_coef (5e-3): it would dominate
    excludes = ("entropy_adv",)
    needs_reference = True
    summary = "VIMPO: value implied by the policy/reference log-ratio, critic-free (Kang et al. 2026)"

    def __init__(self, cfg: ImplicitValueConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self.ref_logps: list[torch.Tensor] = []  # per row [T_i], the reference's token log-probs
        self.kls: list[torch.Tensor] = []  # per row [T_i], exact KL(pi_start || pi_ref) per position
        self.target: torch.Tensor | None = None  # [N] R - mean_group(R)
        self.mini_rows = 1.0

    @classmethod
    def check(cls, cfg: ImplicitValueConfig, run_cfg: Any) -> None:
        if not cfg.enabled or run_cfg is None:
            return
        rec = run_cfg.resolved_recipe()
        for key, value in (("algo.kl_coef", rec.kl_coef), ("algo.js_coef", rec.js_coef)):
            if value > 0:  # the reference code refuses a second KL path: the implied value already holds beta KL
                raise ValueError(f"plugins.implicit_value.enabled needs {key}=0 (the implied value already "
                                 f"carries the KL to the reference); it is {value}")

    def begin_update(self, data: Any, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> Stats:
        """Reference log-probs, exact per-token KL and each row's target at the start parameters."""
        n = len(data)
        if not n:
            self.target = None
            return {}
        fwd = self.ctx.forward
        self.ref_logps, self.kls = [torch.empty(0)] * n, [torch.empty(0)] * n
        policy_logps: list[torch.Tensor] = [torch.empty(0)] * n
        with torch.no_grad():
            for idx, mb in fwd.micro_batches(list(range(n)), data):
                logits, ref_logits = fwd.logits(fwd.model, mb), fwd.reference_logits(mb)
                lp = token_logprobs(logits, mb.response_ids, fwd.temperature)
                ref = token_logprobs(ref_logits, mb.response_ids, fwd.temperature)
                kl = exact_kl(logits, ref_logits, fwd.temperature)
                for k, j in enumerate(idx):
                    length = len(data.response_ids[j])
                    policy_logps[j] = lp[k, :length].double().cpu()
                    self.ref_logps[j] = ref[k, :length].double().cpu()
                    self.kls[j] = kl[k, :length].double().cpu()
        rewards = data.rewards if data.rewards is not None else torch.tensor(data.scores)
        self.target = centred_rewards(rewards.double(), data.group_ids)
        tc = self.ctx.cfg.train
        self.mini_rows = n / tc.mini_batches
        terminal = torch.stack([self.cfg.beta * (policy_logps[i] - self.ref_logps[i] - self.kls[i]).sum()
                                for i in range(n)])
        residual = terminal - self.target
        value_loss = 0.5 * float(residual.pow(2).mean())
        tokens = torch.cat(self.kls)
        return {"implicit_value/term": self.cfg.value_coef * value_loss,
                "implicit_value/value_loss": value_loss,
                "implicit_value/terminal_value_mean": float(terminal.mean()),
                "implicit_value/target_rms": float(self.target.pow(2).mean().sqrt()),
                "implicit_value/kl_mean": float(tokens.mean()) if tokens.numel() else 0.0}

    def shape_advantages(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats]:
        """``actor_coef`` times the whitened policy-implied advantages of the micro-batch's rows."""
        t, c = terms, self.cfg
        ref = _pad([self.ref_logps[j] for j in t.rows], t.logp)
        kl = _pad([self.kls[j] for j in t.rows], t.logp)
        tau = c.beta * (t.logp.detach() - ref - kl) * t.mask
        raw = implied_advantages(tau, t.mask, c.lam)
        adv = masked_whiten(raw, t.mask) if c.whiten else raw
        n = t.mask.sum().clamp(min=1)
        return c.actor_coef * adv, {"implicit_value/adv_raw_abs_mean": float((raw.abs() * t.mask).sum() / n)}

    def surrogate(self, rows: list[int], seq_logp: torch.Tensor) -> torch.Tensor | float:
        """The value loss of ``rows``, its share of the mini-batch's mean (gradient through ``seq_logp``)."""
        if self.target is None:
            return 0.0
        dev, dt = seq_logp.device, seq_logp.dtype
        base = torch.tensor([float((self.ref_logps[j] + self.kls[j]).sum()) for j in rows], device=dev, dtype=dt)
        target = self.target[rows].to(dev, dt)
        residual = self.cfg.beta * (seq_logp - base) - target
        return self.cfg.value_coef * 0.5 * residual.pow(2).sum() / self.mini_rows


def exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per position ``KL(softmax(z/T) || softmax(z_ref/T))`` over the vocabulary, ``[n, T, V]`` -> ``[n, T]``."""
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / t, dim=-1)
    ref = torch.log_softmax(ref_logits.float() / t, dim=-1)
    return (logp.exp() * (logp - ref)).sum(-1)


def centred_rewards(rewards: torch.Tensor, group_ids: list[Any]) -> torch.Tensor:
    """``R_i - mean(R over i's group)``: the target of the implied value ``V(s_0)`` baseline."""
    out = torch.empty_like(rewards)
    groups: dict[Any, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    for rows in groups.values():
        out[rows] = rewards[rows] - rewards[rows].mean()
    return out


def implied_advantages(tau: torch.Tensor, mask: torch.Tensor, lam: float) -> torch.Tensor:
    """``A_t = sum_{k >= t, valid} lam^(k-t) tau_k`` (``[n, T]``): GAE with gamma 1 on the values
    ``V_t = -sum_{k >= t} tau_k`` the token terms imply, whose TD residual is ``tau_t``; 0 on padding."""
    out = torch.zeros_like(tau)
    running = torch.zeros_like(tau[:, 0])
    for t in reversed(range(tau.shape[1])):
        m = mask[:, t]
        running = (tau[:, t] + lam * running) * m + running * (1 - m)
        out[:, t] = running * m
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` over the valid entries (unbiased variance, as verl's ``masked_whiten``),
    0 on padding; fewer than two valid entries: centred only (which is 0)."""
    n = mask.sum()
    if float(n) < 2:
        return (values - (values * mask).sum() / n.clamp(min=1)) * mask
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask).pow(2)).sum() / (n - 1)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS) * mask


def _pad(rows: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like.detach())
    for i, r in enumerate(rows):
        n = min(r.shape[0], out.shape[1])
        out[i, :n] = r[:n].to(out.device, out.dtype)
    return out
