"""Learning-rate schedules: a pure function of the step, so a resumed run sets exactly the same rates.

For the step with 0-based index ``i`` of a run of ``T`` steps (``steps``), peak rate ``lr``, ``W`` warm-up
steps (``optim.warmup_steps``) and floor ratio ``r`` (``optim.min_lr_ratio``):

* warm-up, ``i < W``: ``lr * (i + 1) / W`` (linear, never 0, so the first update already moves);
* after it, with progress ``p = (i - W) / max(1, T - W)`` in ``[0, 1)``:

  - ``constant``: ``lr``;
  - ``linear``:   ``lr * (r + (1 - r) * (1 - p))``;
  - ``cosine``:   ``lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)``.

The first step after warm-up runs at ``lr``; the decay reaches ``lr * r`` at ``i = T``, the rate after the
last update. The decay is that of the Hugging Face schedulers at the same 0-based update index
(``get_linear_schedule_with_warmup``: ``(T - i) / (T - W)``); the warm-up is one step ahead of theirs
(``i / W``, whose first update runs at rate 0), so the last warm-up step already reaches ``lr`` (the cosine form with
a floor is verl's ``get_cosine_schedule_with_warmup`` with ``min_lr_ratio``, half a cycle). TRL's GRPO
default is ``linear`` with ``r = 0``. The schedule depends on ``T``: resuming with a larger ``--steps``
stretches the decay from the resumed step on.
"""

from __future__ import annotations

import math
from typing import Any

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(optim: Any, step_index: int, total_steps: int) -> float:
    """The learning rate of the step with 0-based index ``step_index`` (formulas in the module docstring).

    ``optim`` carries ``lr``, ``warmup_steps``, ``schedule`` and ``min_lr_ratio`` (an ``OptimConfig``).
    """
    if step_index < 0:
        raise ValueError(f"step_index must be >= 0, got {step_index}")
    if optim.schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={optim.schedule!r}; known: {', '.join(SCHEDULES)}")
    warm = optim.warmup_steps
    if step_index < warm:
        return optim.lr * (step_index + 1) / warm
    if optim.schedule == "constant":
        return optim.lr
    progress = min(1.0, (step_index - warm) / max(1, total_steps - warm))
    floor = optim.min_lr_ratio
    shape = 1.0 - progress if optim.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.lr * (floor + (1.0 - floor) * shape)
