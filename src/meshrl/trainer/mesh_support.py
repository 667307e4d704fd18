"""Trainer side of Mesh Learning: coach prefixes for the training problems and balancing weights."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

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


def balance_row_weights(cfg, data, seq_logp: torch.Tensor, ref_seq_logp: torch.Tensor | None):
    """Per-rollout weights ``w`` with ``grad J = sum_j w_j grad seq_logp_j`` (see
    :func:`meshrl.mesh.strategy_balance_row_weights`), computed once per step at the sampling parameters,
    plus the term's metrics with not-applicable (NaN) entries dropped."""
    from meshrl.mesh import strategy_balance_row_weights
    from meshrl.trainer.rollout_step import CORRECT_AT

    # Rows of the bare group (strategy -1) have no prefix: they are not a strategy cell to balance.
    correct = torch.tensor([s >= CORRECT_AT and k >= 0 for s, k in zip(data.scores, data.strategy_ids, strict=True)])
    w, _loss, metrics = strategy_balance_row_weights(
        seq_logp, ref_seq_logp, correct, data.query_ids, data.strategy_ids, cfg.balance_mu,
        subtract_ref=cfg.mesh.subtract_ref, reduction=cfg.mesh.reduction,
    )
    return w, {k: v for k, v in metrics.items() if v == v}


def _bare_seq_logp(trainer, mb) -> torch.Tensor:
    from meshrl.trainer.batch import token_logprobs

    logits = trainer.logits_of(trainer.model, mb)
    logp = token_logprobs(logits, mb.response_ids, trainer.cfg.rollout.temperature)
    return (logp * mb.response_mask).sum(-1)


def support_row_weights(trainer, data) -> tuple[torch.Tensor, dict[str, float]]:
    """Weights of meshrl's support balancing (:func:`meshrl.mesh.support_balance_row_weights`): one
    no-grad forward of the correct rollouts under their bare queries, at the step's start parameters."""
    from meshrl.mesh import support_balance_row_weights
    from meshrl.trainer.rollout_step import CORRECT_AT

    correct = [s >= CORRECT_AT and k >= 0 for s, k in zip(data.scores, data.strategy_ids, strict=True)]
    seq = torch.zeros(len(data), dtype=torch.float64)
    with torch.no_grad():
        for idx, mb in trainer._micro_batches([j for j, ok in enumerate(correct) if ok], data, bare=True):
            seq[idx] = _bare_seq_logp(trainer, mb).double().cpu()
    w, metrics = support_balance_row_weights(seq, torch.tensor(correct), data.query_ids, data.strategy_ids,
                                             trainer.cfg.balance_mu, reduction=trainer.cfg.mesh.reduction)
    return w, {k: v for k, v in metrics.items() if v == v}


def support_backward(trainer, rows: list[int], data, params, acc: list[torch.Tensor] | None):
    """Add the gradient of ``sum_j w_j log pi(tau_j | bare query)`` over the weighted ``rows`` to ``acc``
    (kept apart from the policy gradient, as the paper form's, for ``mesh/grad_ratio``)."""
    weighted = [j for j in rows if trainer.support_w[j] != 0]
    for idx, mb in trainer._micro_batches(weighted, data, bare=True):
        seq = _bare_seq_logp(trainer, mb)
        w = trainer.support_w[idx].to(seq.dtype).to(seq.device)
        grads = torch.autograd.grad((w * seq).sum(), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        acc = grads if acc is None else [a + g for a, g in zip(acc, grads, strict=True)]
    return acc
