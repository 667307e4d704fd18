"""``plugins.fork``: the policy gradient on the high-entropy "forking" tokens only (Wang et al. 2025, "Beyond the
80/20 Rule", arXiv 2506.01939): the top ``top_frac`` of the micro-batch's valid tokens by entropy keep their loss.

The quantile is taken per micro-batch, as in the paper's own code, so the selection (and, with ``norm=selected``,
which rows count in the micro-batch's mean) depends on ``train.micro_batch_size``: a row with no kept token trains
nothing, and with ``norm=selected`` and a mean aggregation (``token-mean``, ``seq-mean-token-mean``,
``seq-mean-token-sum``) the other rows of its micro-batch share its weight. Besides ``fork/frac_tokens`` the
plug-in logs what it leaves untrained, each a share of the micro-batch's rows with a response token (row-weighted
over the step): ``fork/rows_unkept`` (rows with no kept token), ``fork/rows_adv_pos`` and
``fork/rows_unkept_adv_pos`` (rows with a positive advantage, and those of them with no kept token: their ratio is
the share of the rewarded replies the step does not reinforce), and ``fork/first_kept`` (rows whose first response
token is kept: the opening, which all rows of a group share a distribution for, is trained for the whole group or
for none of it when the group lies in one micro-batch, ties aside).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.algos import token_mask
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, Stage, Stats, TokenTerms, register


@dataclass
class ForkConfig:
    enabled: bool = setting(False, help="train on the highest-entropy tokens only")
    top_frac: float = setting(0.2, gt=0, le=1, help="rho: the highest-entropy share of the micro-batch's tokens")
    norm: str = setting("selected", choices=("selected", "all"),
                        help="the loss mean over the kept tokens (selected, the paper) or every token (all, TRL)")


@register
class Fork(Plugin):
    name = "fork"
    Config = ForkConfig
    stage = Stage.TOKEN_SELECTION
    order = 3.0
    summary = "forking tokens: gradient on the top-entropy tokens (Wang et al. 2025)"

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        weight, agg_mask, stats = token_mask(f"fork_{self.cfg.norm}", terms.entropy, terms.mask,
                                             top_frac=self.cfg.top_frac)
        return pg_mat * weight, agg_mask, {**stats, **untrained_shares(weight, terms.mask, terms.adv)}


def untrained_shares(keep: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor) -> Stats:
    """Shares of the rows with a response token: with no kept token (overall and among positive advantages),
    with a positive advantage, and with the first response token kept. ``adv`` is ``[n]`` or ``[n, T]`` (a
    row's sign is that of its advantage summed over its valid tokens)."""
    valid = mask > 0
    rows = valid.any(-1)
    n = max(int(rows.sum()), 1)
    unkept = rows & ~((keep > 0) & valid).any(-1)
    row_adv = adv if adv.ndim == 1 else (adv * valid).sum(-1)
    pos = rows & (row_adv > 0)
    first = valid.float().argmax(-1, keepdim=True)  # the first valid position of each row
    first_kept = rows & (keep.gather(-1, first).squeeze(-1) > 0)
    return {"fork/rows_unkept": float(unkept.sum()) / n, "fork/rows_adv_pos": float(pos.sum()) / n,
            "fork/rows_unkept_adv_pos": float((unkept & pos).sum()) / n, "fork/first_kept": float(first_kept.sum()) / n}
