"""``plugins.ssd``: simple self-distillation, an SFT (negative log-likelihood) term on the policy's own raw samples.

Source: Zhang, Bai, Zheng, Jaitly, Collobert, Zhang 2026, "Embarrassingly Simple Self-Distillation Improves Code
Generation", arXiv 2604.01193, and its reference code (github.com/apple/ml-ssd, ``data_generation/config.yaml``
and ``generate.py``). SSD samples solutions from the model at a training-time temperature ``T_train`` with top-k
/ top-p truncation, keeps them with no correctness filter, no verifier and no teacher, and fine-tunes the model
on them with the standard cross-entropy:

    L = - sum_t log p_theta(y_t | x, y_<t),    y ~ p_theta(. | x; T_train, top_k, top_p)

with ``log p_theta`` the model's own distribution (temperature 1), so the truncated, tempered sampling
distribution is folded into the model. Defaults are the released configuration: ``T_train = 1.5``,
``top_k = 20``, ``top_p = 0.8`` (TRL's SSD trainer documents 0.6 / 20 / 0.95 as its example). The reference
pipeline also drops the shortest 10 % of its samples before SFT; that whole-data-set filter has no per-step
counterpart here and is not applied.

Inside RL, ``coef`` times the recipe's aggregation of ``L``'s per-token terms is added to each micro-batch's loss.
``samples``:

- ``extra`` (default): after the step's rollouts are drawn, one more sample per rollout row is drawn from the
  same prompt through the run's own rollout backend (the current policy, its seed from the run seed and the
  batch) at ``temperature`` / ``top_k`` / ``top_p``; the term is the NLL of those samples. A batch a plug-in
  reuses (``plugins.replay``) keeps the samples drawn with it. The samples are not checkpointed: a run resumed
  in the middle of a replay cycle draws them again with the same seed but under the resumed policy, so from that
  cycle's end on it matches the uninterrupted run, and within that cycle it may not. The extra samples' forward
  runs with its graph beside the rollouts', about twice the activation memory of a plain update;
- ``rollouts``: the NLL of the step's own rollouts, no extra sampling; SSD's data only when the rollout settings
  are SSD's (``rollout.temperature``; the rollouts have no top-k).

A row's prompt is the one its rollout was sampled under (with a Mesh coach prefix, that prefix). Metrics:
``ssd/nll`` (the term before ``coef``), with ``samples=extra`` also ``ssd/sample_tokens`` (mean sample length),
``ssd/truncated_frac`` (samples that hit ``rollout.max_new_tokens``) and ``time/ssd_sample_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import aggregate
from meshrl.settings import setting
from meshrl.trainer.batch import token_logprobs
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, TokenTerms, register

SAMPLE_SOURCES = ("extra", "rollouts")


@dataclass
class SsdConfig:
    enabled: bool = setting(False, help="add an SFT (NLL) term on the policy's own unfiltered samples (simple "
                                        "self-distillation)")
    coef: float = setting(1.0, gt=0, help="weight of the NLL term in the loss")
    samples: str = setting("extra", choices=SAMPLE_SOURCES,
                           help="extra: one more sample per rollout row at the settings below; rollouts: the step's "
                                "own rollouts")
    temperature: float = setting(1.5, gt=0, help="extra: the sampling temperature T_train (apple/ml-ssd's config)")
    top_k: int = setting(20, ge=0, help="extra: keep the top_k most likely tokens (0: off)")
    top_p: float = setting(0.8, gt=0, le=1, help="extra: nucleus mass kept after top_k (1: off)")


@register
class Ssd(Plugin):
    """Extra samples per fresh batch (:meth:`batch_ready`), an NLL term per micro-batch (module docstring)."""

    name = "ssd"
    episodes_ok = False  # reads each response as one sampled stream; an episode interleaves tool output
    Config = SsdConfig
    stage = Stage.EXTRA_LOSS
    order = 3.0
    token_level = False  # a term of its own: fine with the sequence-level losses
    summary = "simple self-distillation: NLL of the policy's own raw samples at T_train, top-k, top-p"

    def __init__(self, cfg: SsdConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self.samples: list[list[int]] | None = None  # one response per row of the batch they were drawn for
        self._texts: list[str] | None = None  # that batch's texts (a reused batch is a copy sharing them)
        self._prompts: list[list[int]] = []
        self._sample_stats: Stats = {}
        self._rows: list[int] | None = None

    def batch_ready(self, step: int, data: Any) -> None:
        """Draw one sample per row of the fresh batch, right after its rollouts (``samples=extra``)."""
        if self.cfg.samples == "extra":
            self.draw(data)

    def draw(self, data: Any) -> None:
        """One sample per row of ``data`` from its prompt, at SSD's settings, through the run's rollout backend;
        seeded by the run seed and the batch's first problem draw, so that a batch gets the same samples whenever
        they are drawn."""
        from meshrl.rollout import SamplingParams

        c, run = self.cfg, self.ctx.cfg
        self.samples, self._texts, self._prompts, self._sample_stats = None, data.texts, [], {}
        if not len(data):
            return
        t0 = time.perf_counter()
        params = SamplingParams(max_new_tokens=run.rollout.max_new_tokens, temperature=c.temperature, top_p=c.top_p,
                                top_k=c.top_k, n=1)
        self._prompts = [list(p) for p in data.prompt_ids]
        first = int(data.query_ids[0]) if data.query_ids else 0
        out = self.ctx.rollouts.backend.generate(self._prompts, params, seed=sample_seed(run.seed, first))
        if len(out) != len(data):
            raise RuntimeError(f"plugins.ssd: the backend returned {len(out)} samples for {len(data)} prompts")
        self.samples = [list(r) for r in out.response_ids]
        self._sample_stats = {
            "ssd/sample_tokens": sum(len(r) for r in self.samples) / len(self.samples),
            "ssd/truncated_frac": sum(bool(t) for t in out.truncated) / len(out.truncated),
            "time/ssd_sample_s": time.perf_counter() - t0,  # time/: left out of bit-for-bit comparisons
        }

    def begin_update(self, data: Any, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> Stats:
        """The samples' metrics; a reused batch without samples (a run resumed mid-cycle) gets them now."""
        if self.cfg.samples != "extra":
            return {}
        if self.samples is None or data.texts is not self._texts:
            self.draw(data)
        return dict(self._sample_stats)

    def shape_advantages(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats]:
        """Leaves the advantages alone; remembers which step rows the micro-batch holds, since the loss hook that
        follows in the same micro-batch (:meth:`extra_loss`) is given the collated batch only."""
        self._rows = list(terms.rows)
        return terms.adv, {}

    def extra_loss(self, mb: Any, logits: torch.Tensor, total: torch.Tensor, stats: Stats) -> torch.Tensor:
        run, forward = self.ctx.cfg, self.ctx.forward
        rows, self._rows = self._rows, None
        if self.cfg.samples == "rollouts":
            ids, mask = mb.response_ids, mb.response_mask
        else:
            if rows is None or len(rows) != logits.shape[0] or self.samples is None:
                raise RuntimeError("plugins.ssd: the micro-batch's rows were not seen before its loss")
            smb = forward.collate([self._prompts[j] for j in rows], [self.samples[j] for j in rows])
            logits = forward.logits(forward.model, smb)
            ids, mask = smb.response_ids, smb.response_mask
        nll_mat = -token_logprobs(logits, ids, 1.0) * mask  # SFT: the model's own distribution, temperature 1
        nll = aggregate(nll_mat, mask, self.ctx.recipe.loss_agg, norm_len=run.rollout.max_new_tokens)
        total = total + self.cfg.coef * nll
        stats["ssd/nll"] = float(nll.detach())
        stats["loss/total"] = float(total.detach())
        return total


def sample_seed(run_seed: int, first_draw: int) -> int:
    """The extra samples' seed, from the run seed and the batch's first problem draw (its cursor position)."""
    return run_seed * 1_000_033 + first_draw * 7_919 + 104_729
