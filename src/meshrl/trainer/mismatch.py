"""The training-inference mismatch, measured every step (docs/plugins.md, "Training-inference mismatch").

The rollout backend returns its own log-prob of every sampled token (``Rollouts.engine_logprobs``, in the
backend's precision): the in-process samplers the tempered ``log softmax(logits / T)[y]`` over the whole
vocabulary, vLLM the log-prob under the top-p distribution it drew from (``RolloutBackend.logprobs_truncated``),
to which the update adds back the log mass the top-p set keeps (:func:`sampler_logps`); the update scores the
same tokens with the training forward. Their difference is the mismatch of Yao et al.
2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"): nonzero whenever the two
forwards differ in precision or kernels (a bf16 sampler, vLLM), so that "on-policy" training is in fact
slightly off-policy. :class:`MismatchMonitor` collects, per step, the update's log-probs of the old policy the
first time each row passes through the loss (``pi_old``: the first epoch's forward, or the precomputed old
log-probs; no extra forward) and logs ``mismatch/*`` (:func:`meshrl.algos.logprob_mismatch_stats`) against the
sampler's. ``plugins.rollout_corr`` corrects the loss for it.
"""

from __future__ import annotations

from typing import Any

import torch

from meshrl.algos import logprob_mismatch_stats


def unsampled_rows(data: Any) -> set[int]:
    """Rows whose tokens the sampler did not all choose: any row a plug-in made or forced part of (an off-policy
    trace, a forced opening: ``StepData.origin`` / ``StepData.unsampled``)."""
    return {i for i, (o, n) in enumerate(zip(data.origin, data.unsampled, strict=True)) if o or n}


def sampler_logps(data: Any, rows: list[int]) -> list[list[float] | None]:
    """The sampler's log-probs of step ``rows`` over the whole tempered vocabulary, the trainer's measure (None
    where a row has none or was not sampled). A backend that reports log-probs under its truncated (top-p)
    distribution gets the row's log kept mass added back (``StepData.rollout_log_kept``): without it, every token
    would show a gap of ``-log(kept mass)`` that is truncation, not mismatch, and an importance ratio
    ``pi_train / pi_sampler`` would be biased by it (meshrl.rollout.truncation)."""
    return whole_vocab_rows(data, data.rollout_logps, unsampled_rows(data), rows)


def whole_vocab_rows(data: Any, logps: list[list[float] | None], skip: set[int], rows: list[int]
                     ) -> list[list[float] | None]:
    """``logps`` of ``rows`` (None for skipped or missing ones), each plus its ``rollout_log_kept`` if set."""
    kept = getattr(data, "rollout_log_kept", None)
    out: list[list[float] | None] = []
    for j in rows:
        r = logps[j] if j < len(logps) and j not in skip else None
        if r is not None and kept is not None and j < len(kept) and len(kept[j]) == len(r):
            r = (torch.tensor(r, dtype=torch.float64) + kept[j].double()).tolist()
        out.append(r)
    return out


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


class MismatchMonitor:
    """Per step: the sampler's log-probs against the update's ``pi_old`` on the same tokens (module docstring).

    :meth:`begin` at sampling, :meth:`observe` from the loss of every micro-batch (only a row's first pass
    counts), :meth:`finish` after the update. ``skip`` rows (off-policy traces) are left out."""

    def __init__(self) -> None:
        self.rollout: list[list[float] | None] = []
        self.skip: set[int] = set()
        self.old: dict[int, torch.Tensor] = {}
        self.mask: dict[int, torch.Tensor] = {}
        self.data: Any = None
        self.announced = False

    def begin(self, data: Any, skip: set[int]) -> None:
        self.data = data
        self.rollout = list(getattr(data, "rollout_logps", []) or [])
        self.skip = set(skip)
        self.old, self.mask = {}, {}

    def rows(self, idx: list[int]) -> list[list[float] | None]:
        """The sampler's log-probs of step rows ``idx`` over the whole vocabulary (:func:`sampler_logps`; None
        where a row has none or is skipped)."""
        return whole_vocab_rows(self.data, self.rollout, self.skip, idx)

    def observe(self, idx: list[int], old: torch.Tensor, mask: torch.Tensor) -> None:
        """Keep ``old [n, T]`` and the loss ``mask`` of each row of ``idx`` the first time the row is seen this step,
        over the row's whole response: an episode's mask has 0s on the tool's output between the model's turns,
        where the sampler's log-probs are placeholders, so only the 1s are compared."""
        for k, j in enumerate(idx):
            if j not in self.old:
                n = len(self.data.response_ids[j]) if self.data is not None else int(mask[k].sum())
                self.old[j] = old[k, :n].detach().float().cpu()
                self.mask[j] = mask[k, :n].detach().float().cpu()

    def finish(self) -> dict[str, float]:
        """``mismatch/*`` over every observed row with sampler log-probs of the same length ({} when none)."""
        idx = list(range(len(self.rollout)))
        both = [(j, (self.old[j], r)) for j, r in zip(idx, self.rows(idx), strict=True)
                if r is not None and j in self.old and len(r) == self.old[j].shape[0] and len(r) > 0]
        observed, pairs = [j for j, _ in both], [p for _, p in both]
        if not pairs:
            return {}
        width = max(len(r) for _, r in pairs)
        old = torch.zeros(len(pairs), width)
        mask = torch.zeros(len(pairs), width)
        for i, (j, (o, _)) in enumerate(zip(observed, pairs, strict=True)):
            old[i, : o.shape[0]], mask[i, : o.shape[0]] = o, self.mask[j]
        rollout, _ = rows_tensor([r for _, r in pairs], old)
        return logprob_mismatch_stats(old, rollout, mask)

    def setup_event(self, backend: Any, model: torch.nn.Module, update_autocast: bool, step: int
                    ) -> dict[str, Any] | None:
        """Once per run: an ``events.jsonl`` record naming the backend and the two precisions compared."""
        if self.announced:
            return None
        self.announced = True
        weights = str(next(model.parameters()).dtype).removeprefix("torch.")
        rollout = backend.precision(weights)
        update = "autocast-bfloat16" if update_autocast else weights
        return {"step": step, "event": "mismatch_setup", "backend": backend.name,
                "rollout_precision": rollout, "update_precision": update}
