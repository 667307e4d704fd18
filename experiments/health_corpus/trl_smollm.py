"""The TRL part of the doctor's corpus: TRL's ``GRPOTrainer`` on SmolLM2-135M-Instruct with meshrl's
``HealthCallback`` attached, the README's addition task.

``python -m experiments.health_corpus.trl_smollm --out DIR`` trains :data:`STEPS` steps of
:data:`PROMPTS` problems x :data:`GROUP` completions (TRL 1.16: fp32, no vLLM, no gradient checkpointing, lr
:data:`LR` as the README's meshrl job), once healthy and once with the learning rate x100 from
:data:`FAULT_STEP` (a ``TrainerCallback`` that scales the optimiser's rate at that step's beginning). The callback
checks every step (``HealthCallback(every=1)``), so the run directory holds TRL's ``trainer_state.json`` and the
monitor's ``health_events.jsonl``, read by ``meshrl doctor --engine trl``. No held-out evaluation runs inside TRL
here (a step already takes about half a minute on this CPU), so ``harm_step`` is null: these runs count for false
alarms (healthy) and detection and delay (lr x100), not for lead time. Runs go to
``DIR/smollm2/trl/<kind>/s<seed>/`` with ``label.json``; a labelled run is reused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from experiments.health_corpus.failures import check_label
from experiments.health_corpus.smollm import addition_rows

STEPS = 10
FAULT_STEP = 6
PROMPTS, GROUP = 2, 8
MAX_NEW = 48
LR = 1e-6
log = logging.getLogger("meshrl")


def _lr_blowup_callback(factor: float, at_step: int):
    from transformers import TrainerCallback

    class LrBlowup(TrainerCallback):
        """Multiplies every parameter group's learning rate by ``factor`` from step ``at_step`` (1-based) on."""

        def __init__(self) -> None:
            self.done = False

        def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            if not self.done and state.global_step + 1 >= at_step:
                scheduler = lr_scheduler
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
                for group in optimizer.param_groups:
                    group["lr"] *= factor
                self.done = True

    return LrBlowup()


def train_trl(kind: str, seed: int, path: Path) -> float:
    """One TRL run into ``path``; returns its seconds."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from meshrl.integrations.trl import HealthCallback
    from meshrl.models import load_model
    from meshrl.rewards import grade

    model, tok = load_model("smollm2-135m")
    rows = [{"prompt": [{"role": "user", "content": f"{r['problem']}\n\nEnd your reply with the final answer as a "
                                                     "number."}], "answer": str(r["answer"])}
            for r in addition_rows()[:400]]

    def reward(completions, answer, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(grade(t, a, "last_number")) for t, a in zip(texts, answer, strict=True)]

    args = GRPOConfig(output_dir=str(path), seed=seed, use_cpu=True, use_vllm=False, bf16=False, fp16=False,
                      gradient_checkpointing=False, per_device_train_batch_size=PROMPTS * GROUP,
                      num_generations=GROUP, max_completion_length=MAX_NEW, learning_rate=LR, max_steps=STEPS,
                      logging_steps=1, report_to=[], save_strategy="no", log_completions=True,
                      disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0)
    callbacks = [_lr_blowup_callback(100.0, FAULT_STEP)] if kind == "lr_blowup" else []
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=callbacks)
    HealthCallback(every=1).attach(trainer)
    t0 = time.perf_counter()
    trainer.train()
    trainer.state.save_to_json(str(path / "trainer_state.json"))
    return time.perf_counter() - t0


def label(kind: str, seed: int, seconds: float) -> dict:
    note = (f"TRL 1.16 GRPOTrainer, SmolLM2-135M-Instruct, the README's addition task, {PROMPTS}x{GROUP} "
            f"completions, {MAX_NEW} tokens, lr {LR:g}, {STEPS} steps, seed {seed}, HealthCallback every step; "
            + ("no fault" if kind == "healthy" else f"lr x100 from step {FAULT_STEP}") + f"; {seconds:.0f} s")
    return check_label({"id": f"smollm2/trl/{kind}/s{seed}", "source": "smollm2/trl", "engine": "trl",
                        "outcome": "healthy" if kind == "healthy" else "harmful", "kind": kind,
                        "fault_step": None if kind == "healthy" else FAULT_STEP, "harm_step": None, "steps": STEPS,
                        "split": "tune" if seed % 2 == 0 else "report", "note": note})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.health_corpus.trl_smollm", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", nargs="+", default=["healthy:0", "lr_blowup:1"], metavar="KIND:SEED")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for item in args.runs:
        kind, _, seed = item.partition(":")
        path = args.out / "smollm2" / "trl" / kind / f"s{seed}"
        if (path / "label.json").is_file():
            log.info("reused %s", path)
            continue
        path.mkdir(parents=True, exist_ok=True)
        seconds = train_trl(kind, int(seed), path)
        (path / "label.json").write_text(json.dumps(label(kind, int(seed), seconds), indent=1) + "\n")
        log.info("wrote %s (%.0f s)", path, seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
