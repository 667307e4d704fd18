"""The real-model part of the doctor's corpus: meshrl GRPO on SmolLM2-135M-Instruct (``model=smollm2-135m``).

``python -m experiments.health_corpus.failures --out DIR --smollm2`` trains, one after another, the README's
GRPO job (its addition task: ``What is a + b?`` with ``a, b`` in 1..20, graded by the last number of the reply)
shortened to :data:`STEPS` steps of :data:`PROMPTS_PER_STEP` problems x 8 rollouts: two healthy seeds and one
``lr_blowup`` (``optim.lr`` x100 from :data:`FAULT_STEP`, made as in the tiny runs by a config change at a
resume). Held-out accuracy is evaluated every :data:`EVAL_EVERY` steps on :data:`EVAL_PROBLEMS` held-out
problems (4 samples each), so ``harm_step`` follows the rule of :mod:`experiments.health_corpus.failures`.
Runs go to ``DIR/smollm2/meshrl/<kind>/s<seed>/`` with ``label.json`` (source ``smollm2/meshrl``); a labelled
run is reused. On one thread of a busy 2-core machine a step of 4 x 8 rollouts takes about half a minute (the
README's 8 x 8 took 71 s), so a run takes minutes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from experiments.health_corpus.failures import RunSpec

STEPS = 12
FAULT_STEP = 7  # 6 healthy steps (2 evaluations) before it
EVAL_EVERY = 3
EVAL_PROBLEMS = 32
PROMPTS_PER_STEP = 4  # half the README's 8: a step takes about 35 s on one busy core
LR = 1e-6  # the README's
SEEDS = (0, 1)
DATA_SEED, DATA_SIZE = 0, 1000  # the README's add.jsonl


def addition_rows() -> list[dict[str, object]]:
    """The README's ``add.jsonl``: ``DATA_SIZE`` problems drawn with ``random.seed(DATA_SEED)``."""
    rng = random.Random(DATA_SEED)
    pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(DATA_SIZE)]
    return [{"problem": f"What is {a} + {b}?", "answer": a + b} for a, b in pairs]


def write_data(root: Path) -> Path:
    """``root/_data/add.jsonl`` (rewritten only when its content differs)."""
    path = root / "_data" / "add.jsonl"
    text = "".join(json.dumps(row) + "\n" for row in addition_rows())
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


@dataclass(frozen=True)
class SmolSpec(RunSpec):
    data: str = ""  # the add.jsonl path
    steps: int = STEPS
    fault_at: int = FAULT_STEP

    @property
    def source(self) -> str:
        return "smollm2/meshrl"

    @property
    def run_id(self) -> str:
        return f"{self.source}/{self.kind}/s{self.seed}"

    def overrides(self, model: Path | str) -> list[str]:
        return [f"recipe={self.recipe}", f"model={model}", f"task=jsonl:{self.data}?kind=last_number&eval_fraction=0.1",
                f"steps={self.steps}", f"seed={self.seed}", f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
                "rollout.group_size=8", "rollout.max_new_tokens=64", f"optim.lr={LR}", "optim.warmup_steps=2",
                f"eval.every={EVAL_EVERY}", "eval.n=4", f"eval.limit={EVAL_PROBLEMS}", "log.samples_per_step=16",
                "log.progress=false", "checkpoint.every=100", "checkpoint.keep_last=1"]

    def resume_overrides(self) -> list[str] | None:
        return [f"optim.lr={LR * 100:g}"] if self.kind == "lr_blowup" else None

    def note(self) -> str:
        head = (f"SmolLM2-135M-Instruct, the README's addition task, {self.recipe}, lr {LR:g} (2 warm-up steps), "
                f"{PROMPTS_PER_STEP}x8 rollouts, {self.steps} steps, seed {self.seed}")
        if self.kind == "healthy":
            return f"{head}; no fault"
        return f"{head}; from step {self.fault_at} (config change at a resume): optim.lr x100 -> {LR * 100:g}"


def smollm_specs(root: Path) -> list[SmolSpec]:
    """Two healthy seeds, then one ``lr_blowup`` (the data file is written first)."""
    data = str(write_data(root).resolve())
    return [*(SmolSpec("healthy", seed, data=data) for seed in SEEDS), SmolSpec("lr_blowup", 0, data=data)]
