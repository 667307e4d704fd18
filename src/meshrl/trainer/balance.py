"""Trainer side of Mesh Learning: coach prefixes for the training problems and the balancing term."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from meshrl.runs.correct import is_correct

log = logging.getLogger("meshrl")


def prepare_prefixes(cfg, task, problems, run_dir: Path) -> dict[str, list[str]]:
    """Problem id -> its ``mesh.m`` coach prefixes, checked before training starts.

    With ``mesh.prefixes`` set, prefixes come from that file (made by ``meshrl coach``) and are looked up
    by the stable hash of the problem text. Without it, the task's own rule strategies are run through the
    same validation and cached in ``RUN_DIR/prefixes.jsonl``. A problem without valid prefixes is an error
    that names it: training on a mixture of conditioned and unconditioned queries would be silent bias.
    """
    from meshrl.mesh import RuleCoach, generate_prefixes, prefixes_by_problem

    m = cfg.mesh.m
    path = Path(cfg.mesh.prefixes) if cfg.mesh.prefixes else run_dir / "prefixes.jsonl"
    if cfg.mesh.prefixes is None:
        coach = RuleCoach(lambda q: task.coach_strategies(by_id[q["id"]]), name=f"rule:{task.name}")
        by_id = {p.id: p for p in problems}
        if task.coach_strategies(problems[0]) is None:
            raise ValueError(f"task {task.name} has no rule strategies; run `meshrl coach` and pass "
                             "--set mesh.prefixes=prefixes.jsonl")
        queries = [{"id": p.id, "problem": p.prompt, "answer": p.answer} for p in problems]
        generate_prefixes(queries, coach, m=m, out_path=path)
    elif not path.is_file():
        raise ValueError(f"mesh.prefixes file not found: {path}")
    out, missing = prefixes_by_problem(path, problems, m)
    if missing:
        raise ValueError(f"{len(missing)} of {len(problems)} training problems have no {m} valid prefixes in "
                         f"{path} (first: {', '.join(missing[:5])}); see its .rejects.jsonl or rerun `meshrl coach`")
    return out


class StrategyBalance:
    """Mesh's strategy-balancing term in the update (docs/method.md §1.3, ``mesh.balance``).

    Per-row weights ``w`` with ``grad J = sum_j w_j grad seq_logp_j`` are computed once per step at the start
    parameters (:meth:`begin_update`); each micro-batch then adds ``sum_j w_j seq_logp_j``'s gradient, kept apart
    from the policy term's so that the ratio of their norms is logged (``mesh/grad_ratio``). ``paper``: the
    paper's form on the conditioned log-probs (:func:`meshrl.mesh.strategy_balance_row_weights`); ``support``:
    meshrl's extension on the unconditioned ones, scored with the coach prefix removed
    (:func:`meshrl.mesh.support_balance_row_weights`). Off (no weights, no work) for every other recipe."""

    def __init__(self, cfg, forward) -> None:
        on = cfg.mesh_enabled and cfg.balance_mu > 0
        self.paper = on and cfg.mesh.balance == "paper"
        self.support = on and cfg.mesh.balance == "support"
        self.cfg, self.forward = cfg, forward
        self.paper_weights: torch.Tensor | None = None
        self.support_weights: torch.Tensor | None = None

    @property
    def needs_start_logps(self) -> bool:
        """The paper form weighs rows by their log-probs at the step's start parameters."""
        return self.paper

    @property
    def needs_reference(self) -> bool:
        return self.paper and self.cfg.mesh.subtract_ref

    @property
    def active(self) -> bool:
        """Weights are set this step (every micro-batch must then run whole, here)."""
        return self.paper_weights is not None or self.support_weights is not None

    def begin_update(self, data, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> dict[str, float]:
        self.paper_weights, self.support_weights, stats = None, None, {}
        if self.support:
            self.support_weights, stats = self._support_row_weights(data)
        if self.paper:
            seq = torch.stack([lp.sum() for lp in start_logps])
            ref_seq = torch.stack([lp.sum() for lp in ref_logps]) if self.cfg.mesh.subtract_ref else None
            self.paper_weights, stats = balance_row_weights(self.cfg, data, seq, ref_seq)
        return stats

    def paper_grads(self, rows: list[int], seq_logp: torch.Tensor, params, acc: list[torch.Tensor] | None
                    ) -> list[torch.Tensor]:
        """``acc`` plus the gradient of ``sum_j w_j seq_logp_j`` over micro-batch ``rows``."""
        w = self.paper_weights[rows].to(seq_logp.dtype).to(seq_logp.device)
        return _add_grads(acc, (w * seq_logp).sum(), params)

    def support_grads(self, rows: list[int], data, params, acc: list[torch.Tensor] | None):
        """``acc`` plus the gradient of ``sum_j w_j log pi(tau_j | bare query)`` over the weighted ``rows``."""
        weighted = [j for j in rows if self.support_weights[j] != 0]
        for idx, mb in self.forward.micro_batches(weighted, data, bare=True):
            seq = self.forward.seq_logp(mb)
            w = self.support_weights[idx].to(seq.dtype).to(seq.device)
            acc = _add_grads(acc, (w * seq).sum(), params)
        return acc

    @staticmethod
    def merge(params, balance_grads: list[torch.Tensor]) -> dict[str, float]:
        """Add the balancing gradient into ``.grad``; ``mesh/grad_ratio`` and ``mesh/balance_grad_norm``."""
        policy_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None))
        balance_norm = torch.sqrt(sum((g.float() ** 2).sum() for g in balance_grads))
        for p, g in zip(params, balance_grads, strict=True):
            p.grad = g.clone() if p.grad is None else p.grad + g
        return {"mesh/grad_ratio": float(balance_norm / policy_norm.clamp(min=1e-30)),
                "mesh/balance_grad_norm": float(balance_norm)}

    def _support_row_weights(self, data) -> tuple[torch.Tensor, dict[str, float]]:
        """One no-grad forward of the correct rollouts under their bare queries, at the start parameters."""
        from meshrl.mesh import support_balance_row_weights

        correct = [is_correct(s) and k >= 0 for s, k in zip(data.scores, data.strategy_ids, strict=True)]
        seq = torch.zeros(len(data), dtype=torch.float64)
        with torch.no_grad():
            for idx, mb in self.forward.micro_batches([j for j, ok in enumerate(correct) if ok], data, bare=True):
                seq[idx] = self.forward.seq_logp(mb).double().cpu()
        w, metrics = support_balance_row_weights(seq, torch.tensor(correct), data.query_ids, data.strategy_ids,
                                                 self.cfg.balance_mu, reduction=self.cfg.mesh.reduction)
        return w, {k: v for k, v in metrics.items() if v == v}


def _add_grads(acc: list[torch.Tensor] | None, objective: torch.Tensor, params) -> list[torch.Tensor]:
    grads = torch.autograd.grad(objective, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    return grads if acc is None else [a + g for a, g in zip(acc, grads, strict=True)]


def balance_row_weights(cfg, data, seq_logp: torch.Tensor, ref_seq_logp: torch.Tensor | None):
    """Per-rollout weights ``w`` with ``grad J = sum_j w_j grad seq_logp_j`` (see
    :func:`meshrl.mesh.strategy_balance_row_weights`), computed once per step at the sampling parameters,
    plus the term's metrics with not-applicable (NaN) entries dropped."""
    from meshrl.mesh import strategy_balance_row_weights

    # Rows of the bare group (strategy -1) have no prefix: they are not a strategy cell to balance.
    correct = torch.tensor([is_correct(s) and k >= 0 for s, k in zip(data.scores, data.strategy_ids, strict=True)])
    w, _loss, metrics = strategy_balance_row_weights(
        seq_logp, ref_seq_logp, correct, data.query_ids, data.strategy_ids, cfg.balance_mu,
        subtract_ref=cfg.mesh.subtract_ref, reduction=cfg.mesh.reduction,
    )
    return w, {k: v for k, v in metrics.items() if v == v}
