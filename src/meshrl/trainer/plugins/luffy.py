"""``plugins.luffy``: off-policy traces mixed into each group, with LUFFY's shaped loss on them (Yan et al. 2025,
"Learning to Reason under Off-Policy Guidance", arXiv 2504.14945).

In each advantage group the last ``per_group`` rollouts are replaced by traces of the problem from a JSONL file
(scored by the task like any rollout), rewards and advantages are recomputed over the mixed group, and the trace
rows take the shaped, unclipped loss ``-A f(pi_theta)``, ``f(p) = p / (p + gamma)`` (eq. 6;
:func:`meshrl.algos.luffy_off_policy_loss`). The trace rows are marked as this plug-in's in ``StepData.origin``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshrl.algos import OFF_POLICY_SHAPES, luffy_off_policy_loss
from meshrl.jsonl import iter_jsonl
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, TokenTerms, register


@dataclass
class LuffyConfig:
    enabled: bool = setting(False, help="mix off-policy traces into each group (LUFFY)")
    traces: str = setting("", help='JSONL of traces, one {"id": problem id, "completion": text} per line')
    per_group: int = setting(1, ge=1, help="off-policy rows per advantage group (the rest stay on-policy)")
    gamma: float = setting(0.1, gt=0, help="the shaping f(p) = p / (p + gamma) on the trace tokens")
    shape: str = setting("p_div_p", choices=OFF_POLICY_SHAPES,
                         help="p_div_p: LUFFY's shaping; none: -A p; log: -A log p (trained as if sampled)")


@register
class Luffy(Plugin):
    name = "luffy"
    episodes_ok = False  # reads each response as one sampled stream; an episode interleaves tool output
    Config = LuffyConfig
    stage = Stage.OFF_POLICY
    order = 1.0
    summary = "LUFFY: off-policy traces with a shaped loss (Yan et al. 2025)"

    def __init__(self, cfg: LuffyConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self.traces = load_traces(Path(cfg.traces))

    @classmethod
    def check(cls, cfg: LuffyConfig, run_cfg: Any) -> None:
        if cfg.enabled and not Path(cfg.traces).is_file():
            raise ValueError(f"plugins.luffy.traces: no such file {cfg.traces!r} (a JSONL of "
                             '{"id": problem id, "completion": text} rows)')

    def after_sampling(self, step: int, data: Any, sampler: Any) -> Any:
        """LUFFY's mixed groups (module docstring). Groups without a trace for their problem, or with no on-policy
        row left, stay on-policy; traces longer than ``rollout.max_new_tokens`` are skipped; both are counted
        (``offpolicy/groups_without_trace``, ``offpolicy/skipped_long``)."""
        if not len(data):
            return data
        groups: dict[Any, list[int]] = {}
        for i, g in enumerate(data.group_ids):
            groups.setdefault(g, []).append(i)
        k, missing, too_long = self.cfg.per_group, 0, 0
        max_len = self.ctx.cfg.rollout.max_new_tokens
        for rows in groups.values():
            problem = data.problems[rows[0]]
            texts = self.traces.get(str(problem.id))
            if not texts or len(rows) <= k:
                missing += 1
                continue
            for n, i in enumerate(rows[-k:]):
                text = texts[(data.query_ids[i] + n) % len(texts)]
                ids = trace_ids(self.ctx.tokenizer, text)
                if len(ids) > max_len:
                    too_long += 1
                    continue
                # A trace was not sampled: no sampler log-probs or features (MEI scores it in the update), and the
                # whole row is off-policy (a forced opening included).
                data.replace_row(i, dataclasses.replace(
                    data.row(i), response_ids=ids, text=text, truncated=False, rollout_logps=None,
                    rollout_features=None, score=sampler.rewards([text], [problem])[0], origin=self.name,
                    unsampled=len(ids)))
        # The same shaping and advantages as the sampler's, now over the mixed groups.
        data.rewards = sampler.scoring.shape_rewards(data)
        data.advantages = sampler.scoring.advantages(data.rewards, data.group_ids)
        traces = data.rows_from(self.name)
        off_scores = [data.scores[i] for i in traces]
        data.stats.update({"offpolicy/rows": float(len(traces)),
                           "offpolicy/score_mean": sum(off_scores) / len(off_scores) if off_scores else 0.0,
                           "offpolicy/groups_without_trace": float(missing),
                           "offpolicy/skipped_long": float(too_long)})
        return data

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        """The trace rows take LUFFY's shaped, unclipped loss; the others keep the recipe's."""
        t = terms
        traces = t.batch.rows_from(self.name)
        off = torch.tensor([j in traces for j in t.rows], dtype=torch.bool, device=t.logp.device)
        off_mask = t.mask * off[:, None].to(t.mask.dtype)
        shaped, s = luffy_off_policy_loss(t.logp, t.adv, off_mask, gamma=self.cfg.gamma, shape=self.cfg.shape)
        n = float(t.mask.sum().clamp(min=1))
        return torch.where(off[:, None], shaped, pg_mat), agg_mask, {"offpolicy/frac_tokens": float(off_mask.sum()) / n,
                                                                     **s}


def trace_ids(tokenizer: Any, text: str) -> list[int]:
    """Response token ids of an off-policy trace: its tokens and the eos that ends a finished rollout."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids + [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else ids


def load_traces(path: Path) -> dict[str, list[str]]:
    """``problem id -> [completion, ...]`` from a JSONL of ``{"id": ..., "completion": ...}`` rows; a bad row
    raises ``ValueError`` naming the file, the line and the field."""
    out: dict[str, list[str]] = {}
    for n, row in iter_jsonl(path, what="plugins.luffy.traces", partial_last="raise"):
        for key in ("id", "completion"):
            if key not in row:
                raise ValueError(f"plugins.luffy.traces {path}, line {n}: missing field {key!r}")
        if not isinstance(row["completion"], str) or not row["completion"]:
            raise ValueError(f"plugins.luffy.traces {path}, line {n}: field 'completion' must be a non-empty string")
        out.setdefault(str(row["id"]), []).append(row["completion"])
    if not out:
        raise ValueError(f"{path}: no traces")
    return out
