"""``plugins.sft_mix``: supervised examples for the problems RL cannot solve, inserted into the RL update, with the
SFT loss on the high-entropy tokens only.

Sources:

- ReLIFT (Ma et al. 2025, "Learning What Reinforcement Learning Can't: Interleaved Online Fine-Tuning for Hardest
  Questions", arXiv 2506.07527; reference code TheRoadQaQ/ReLIFT, ``verl/relift/trainer.py``): a question whose
  rollouts in the step are *all* wrong (group accuracy 0, the paper's "hardest" bucket ``acc(q) = 0``) goes into a
  buffer with its demonstration; once the buffer holds ``batch_size`` questions (``sft_data_size``, 64 against a
  train batch of 128 in the reference script) the first ``batch_size`` are trained on with the SFT loss and
  removed from the buffer.
- MIFO (Yuan et al. 2025, "Mitigating Forgetting Between Supervised and Reinforcement Learning Yields Stronger
  Reasoners", arXiv 2510.04454): to limit what SFT overwrites of the RL-learned policy, the SFT loss is computed
  on high-entropy tokens only.

The term, per step that has an SFT batch ``D`` (demonstrations ``y`` of the buffered problems ``x``)::

    L_sft = coef * sum_{(x,y) in D} sum_t keep_t * (-log pi_theta(y_t | x, y_<t)) / sum keep_t
    keep_t = 1[H_t >= quantile_{valid tokens of D}(H, 1 - top_entropy_frac)]

``H_t`` is the policy's entropy at the demonstration's token ``t`` under the parameters at the start of the step's
update (fixed for the step; :func:`meshrl.algos.high_entropy_mask`, ties kept). ``top_entropy_frac = 1`` is
ReLIFT's plain token-mean SFT loss. Two things differ from the papers and are meshrl's choices: ReLIFT takes a
separate optimiser step (its own AdamW) after the RL step, here the term is added to the loss of the step's first
mini-batch (one joint optimiser step, weight ``coef``); MIFO's exact entropy fraction could not be read from the
sources available here, so the default ``top_entropy_frac`` 0.2 is the forking-token share of Wang et al. 2025
(arXiv 2506.01939) that MIFO's high-entropy selection follows. MIFO's other component, freezing the parameters most
changed by RL, is not part of this plug-in.

Hard problems are judged on every rollout the step sampled (``StepData.seen``, before dynamic sampling drops
uniform groups), per problem. Demonstrations come from ``traces`` (the JSONL of ``plugins.luffy.traces``,
:func:`meshrl.trainer.plugins.luffy.load_traces`); a hard problem without one is counted
(``sft/hard_without_trace``), a demonstration longer than ``rollout.max_new_tokens`` is skipped and counted
(``sft/skipped_long``). The buffer is in the checkpoint (prompt and demonstration token ids, exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshrl.algos import high_entropy_mask
from meshrl.runs.correct import is_correct
from meshrl.settings import setting
from meshrl.trainer.batch import token_entropy, token_logprobs
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, register
from meshrl.trainer.plugins.luffy import load_traces, trace_ids


@dataclass
class SftMixConfig:
    enabled: bool = setting(False, help="SFT on demonstrations of the problems the policy cannot solve (ReLIFT), "
                                        "on high-entropy tokens (MIFO)")
    traces: str = setting("", help='JSONL of demonstrations, one {"id": problem id, "completion": text} per line')
    hard_max_acc: float = setting(0.0, ge=0, lt=1, help="a problem is hard when the share of its step's rollouts "
                                                        "that are correct is <= this (ReLIFT: 0, all wrong)")
    batch_size: int = setting(64, ge=1, help="SFT examples per SFT update; trained once the buffer holds this many "
                                             "(ReLIFT's sft_data_size)")
    coef: float = setting(1.0, gt=0, help="weight of the SFT term in the loss")
    top_entropy_frac: float = setting(0.2, gt=0, le=1, help="share of the demonstration tokens, by the policy's "
                                                            "entropy, that carry the SFT loss (1: every token)")


@dataclass
class SftBatch:
    """The step's SFT examples and the tokens that carry their loss (fixed at the update's start)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    keep: list[torch.Tensor]  # per example [T_i] bool
    pending: bool = True  # the term is still to be added (once per step, in the first mini-batch)


@register
class SftMix(Plugin):
    name = "sft_mix"
    Config = SftMixConfig
    stage = Stage.EXTRA_LOSS
    order = 3.0
    token_level = False  # no ratio: works with sequence-level losses too
    summary = "SFT on demonstrations of unsolved problems, high-entropy tokens only (ReLIFT + MIFO)"

    def __init__(self, cfg: SftMixConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self.traces = load_traces(Path(cfg.traces))
        self.buffer: list[tuple[list[int], list[int]]] = []  # (prompt ids, demonstration ids), oldest first
        self.uses: dict[str, int] = {}  # problem id -> demonstrations taken (rotates through several)
        self.batch: SftBatch | None = None

    @classmethod
    def check(cls, cfg: SftMixConfig, run_cfg: Any) -> None:
        if cfg.enabled and not Path(cfg.traces).is_file():
            raise ValueError(f"plugins.sft_mix.traces: no such file {cfg.traces!r} (a JSONL of "
                             '{"id": problem id, "completion": text} rows)')

    # ---- sampling: find the hard problems
    def batch_ready(self, step: int, data: Any) -> None:
        """Buffer a demonstration for each problem of the step whose rollouts' accuracy is ``<= hard_max_acc``."""
        seen = data.seen or list(zip(data.texts, data.scores, data.problems, strict=True))
        by_problem: dict[str, tuple[Any, list[float]]] = {}
        for _, score, problem in seen:
            by_problem.setdefault(str(problem.id), (problem, []))[1].append(score)
        hard = missing = too_long = 0
        max_len = self.ctx.cfg.rollout.max_new_tokens
        for pid, (problem, scores) in by_problem.items():
            if sum(is_correct(s) for s in scores) / len(scores) > self.cfg.hard_max_acc:
                continue
            hard += 1
            texts = self.traces.get(pid)
            if not texts:
                missing += 1
                continue
            n = self.uses.get(pid, 0)
            self.uses[pid] = n + 1
            ids = trace_ids(self.ctx.tokenizer, texts[n % len(texts)])
            if len(ids) > max_len:
                too_long += 1
                continue
            self.buffer.append((list(self.ctx.rollouts.prompt_ids(problem, -1)), ids))
        data.stats.update({"sft/hard_groups": float(hard), "sft/hard_without_trace": float(missing),
                           "sft/skipped_long": float(too_long)})

    # ---- the update
    def begin_update(self, data: Any, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> Stats:
        """Take an SFT batch when the buffer holds ``batch_size`` examples; select its high-entropy tokens and
        score its loss at the start parameters (``sft/term``, ``coef * sft/loss``, is added to ``loss/total``)."""
        self.batch = None
        n = self.cfg.batch_size
        if len(self.buffer) < n:
            return {"sft/rows": 0.0, "sft/buffer": float(len(self.buffer))}
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        prompts, responses = [p for p, _ in taken], [r for _, r in taken]
        entropy_rows: list[torch.Tensor] = []
        logp_rows: list[torch.Tensor] = []
        with torch.no_grad():  # in chunks of train.micro_batch_size: never the whole batch's logits at once
            for _, logits, mb, chunk in self._chunk_logits(prompts, responses):
                entropy, logp = token_entropy(logits.float()), token_logprobs(logits.float(), mb.response_ids)
                entropy_rows += [entropy[i, : len(r)].cpu() for i, r in enumerate(chunk)]
                logp_rows += [logp[i, : len(r)].cpu() for i, r in enumerate(chunk)]
        width = max(len(r) for r in responses)
        entropy, logp = _pad(entropy_rows, width), _pad(logp_rows, width)
        mask = _pad([torch.ones(len(r)) for r in responses], width)
        keep = high_entropy_mask(entropy, mask, top_frac=self.cfg.top_entropy_frac)
        loss = sft_loss(logp, keep)
        self.batch = SftBatch(prompts, responses, [keep[i, : len(r)].cpu() for i, r in enumerate(responses)])
        return {"sft/rows": float(n), "sft/buffer": float(len(self.buffer)), "sft/loss": float(loss),
                "sft/term": self.cfg.coef * float(loss),
                "sft/frac_tokens": float(keep.sum()) / max(float(mask.sum()), 1.0)}

    def surrogate(self, rows: list[int], seq_logp: torch.Tensor) -> torch.Tensor | float:
        """``coef * L_sft``'s gradient, once per step (in the first micro-batch that runs). The SFT batch runs in
        chunks of ``train.micro_batch_size``, each chunk's share of the token mean back-propagated at once, so
        neither its logits nor its graph are held for the whole batch; the value is logged as ``sft/term`` by
        :meth:`begin_update`, and 0 is returned."""
        b = self.batch
        if b is None or not b.pending:
            return 0.0
        b.pending = False
        kept = sum(int(k.sum()) for k in b.keep)
        if kept == 0:
            return 0.0
        for start, logits, mb, chunk in self._chunk_logits(b.prompts, b.responses):
            logp = token_logprobs(logits.float(), mb.response_ids)
            keep = torch.zeros_like(logp)
            for i, k in enumerate(b.keep[start:start + len(chunk)]):
                keep[i, : len(k)] = k.to(logp.dtype)
            (-(logp * keep).sum() * (self.cfg.coef / kept)).backward()
        return 0.0

    def _chunk_logits(self, prompts: list[list[int]], responses: list[list[int]]):
        """``(start, logits, micro-batch, responses)`` per chunk of ``train.micro_batch_size`` examples."""
        size = max(1, int(self.ctx.cfg.train.micro_batch_size))
        for start in range(0, len(prompts), size):
            logits, mb = self._logits(prompts[start:start + size], responses[start:start + size])
            yield start, logits, mb, responses[start:start + size]

    def _logits(self, prompts: list[list[int]], responses: list[list[int]]) -> tuple[torch.Tensor, Any]:
        forward = self.ctx.forward
        mb = forward.collate(prompts, responses)
        return forward.logits(forward.model, mb), mb

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        return {"buffer": [[p, r] for p, r in self.buffer], "uses": dict(self.uses)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.buffer = [(list(p), list(r)) for p, r in state.get("buffer", [])]
        self.uses = {str(k): int(v) for k, v in state.get("uses", {}).items()}


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """``[n, width]`` of 1-D rows, zero-padded on the right."""
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def sft_loss(logp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood over the kept tokens (0 when none is kept)."""
    k = keep.to(logp.dtype)
    return -(logp * k).sum() / k.sum().clamp(min=1)
