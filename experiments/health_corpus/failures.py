"""The deliberate-failure and healthy part of the doctor's labelled corpus: small ``tiny:repeat`` runs with a known
fault injected at a known step, each written as a run directory with ``label.json`` (the corpus schema).

Usage (from the repository root)::

    python -m experiments.health_corpus.failures --out runs/corpus [--only lr_blowup healthy] [--seeds 0 1 2 3]

Each (kind, seed) becomes ``OUT/tiny/failure/<kind>/s<seed>/``; healthy runs ``OUT/tiny/healthy/<recipe>/s<seed>/``
(GRPO, DAPO and Dr. GRPO, so that false alarms are counted over more than one recipe). The label's ``id`` is that
path relative to ``OUT``. A run whose ``label.json`` exists is reused; an unfinished one is trained again. A
labelled run keeps its records, not its checkpoints.

**The set-up.** The built-in ``tiny`` model learns nothing on ``tiny:repeat`` within 40 RL steps from its random
initialisation (reward about 0.02-0.1, held-out accuracy near 0), so there would be no healthy climb before a fault.
Every run therefore starts from one *warm start* (:func:`warm_start`, cached in ``OUT/_warm``): the ``tiny`` model
taught by teacher forcing to answer ``Repeat: s`` with ``s`` half of the time and with a uniformly drawn symbol
otherwise. It starts about a quarter right; GRPO at ``optim.lr=1e-3`` climbs to 0.4-0.5 held-out accuracy by
step 4 and to about 0.7 by step 40 (higher rates wreck the warm start). Held-out accuracy (``eval/mean@1`` on 64
held-out prompts, 16 samples each, graded by the task's own scorer) is logged every :data:`EVAL_EVERY` steps.

**The faults** act from :data:`FAULT_STEP` (the first logged step, 1-based, that the fault acts on) through two
clean seams:

* a trainer plug-in of this module (:class:`FaultPlugin`, ``plugins.custom``) that changes the step's grading after
  sampling, then recomputes the shaped rewards and the advantages with the trainer's own functions (so the update,
  ``metrics.jsonl`` and ``samples.jsonl`` all see the faulty grading, while the held-out evaluation keeps the
  task's strict scorer):

  - ``broken_verifier``: the verifier grades against the wrong answer key (the next symbol of ``0-9a-f``), so
    right answers score 0 and one particular wrong answer scores 1;
  - ``constant_reward``: every rollout scores 0.5;
  - ``broken_grouping``: every rollout gets its own group id (a uid per sample instead of per prompt).

  ``constant_reward`` and ``broken_grouping`` both leave every advantage 0, so their runs train alike (the
  doctor tells them apart by the grouping records); AdamW's momentum still moves the weights for a while after
  the gradient is 0, and held-out accuracy may drift down;
  - ``reward_hacking``: a lenient verifier that pays 1 for any completion containing the loophole symbol ``f`` (a
    format check mistaken for the answer check) and only :data:`HONEST_WEIGHT` (0.5) for a right answer without it
    (the format bonus outweighs correctness), so the training reward rises while the strictly graded held-out
    accuracy falls (with the loophole paid only as much as a right answer, held-out accuracy did not fall within
    the run: both kept rising);

* a config change at a resume: the run trains ``FAULT_STEP - 1`` steps, checkpoints, and is resumed
  (``train(..., resume=True)``) with a changed setting (``config.yaml`` then records the changed one):

  - ``lr_blowup``: ``optim.lr`` x100 (1e-3 -> 0.1);
  - ``bf16_mismatch``: ``rollout.autocast_bf16=true`` (the sampler in bf16 autocast against the fp32 update);
  - ``truncation``: ``rollout.max_new_tokens=1`` (answers are cut before their end-of-turn token). The held-out
    evaluation keeps ``eval.max_new_tokens`` of the healthy runs. On ``tiny:repeat`` a one-character answer still
    scores, so the cut harms only through what is no longer trained (the end-of-turn token), if at all.

No fault had to be injected from step 1. ``--smollm2`` trains the SmolLM2-135M runs instead
(:mod:`experiments.health_corpus.smollm`).

**harm_step** (:func:`harm_step`): with ``drop = meshrl.doctor.DEFAULT.eval_drop_min`` (0.05) and the held-out
accuracy ``a(s)`` of the evaluations at steps ``s``: the first evaluation step ``s >= fault_step`` with
``a(s) <= max{a(t) : t <= s} - drop`` (at least ``drop`` below the best so far) and ``a(s) < a(b)``, where ``b`` is
the last evaluation step before ``fault_step`` (the policy the fault first acted on; the second condition is
dropped when there is none). ``null`` when no evaluation step qualifies, and for healthy runs (no fault).

Labels: deliberate failures are ``outcome: harmful`` whether or not the harm reached held-out accuracy (the fault
is real; ``harm_step`` says whether it showed); healthy runs ``outcome: healthy``. ``split``: even seeds ``tune``,
odd seeds ``report``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshrl.runs.run_dir import is_ours
from meshrl.settings import setting
from meshrl.trainer.plugins import Plugin

STEPS = 40
FAULT_STEP = 13  # the first step the fault acts on: 12 healthy steps (3 evaluations) before it
EVAL_EVERY = 4
LR = 1e-3
SEEDS = (0, 1, 2, 3)
HEALTHY_RECIPES = ("grpo", "dapo", "dr_grpo")
PLUGIN_PATH = "experiments.health_corpus.failures:FaultPlugin"
LOOPHOLE = "f"  # reward_hacking: any completion containing it is paid 1
HONEST_WEIGHT = 0.5  # reward_hacking: what the lenient verifier pays for a right answer without the loophole
CONSTANT = 0.5  # constant_reward's score
SYMBOLS = "0123456789abcdef"  # tiny:repeat's answers

#: Settings of every run (healthy and faulty); ``model`` and ``seed`` are added per run.
BASE = ["task=tiny:repeat", "task_options.eval_size=64", f"optim.lr={LR}",
        "rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=4",
        f"eval.every={EVAL_EVERY}", "eval.n=16", "eval.limit=0", "eval.max_new_tokens=4",
        "log.samples_per_step=16", "log.progress=false", "checkpoint.every=100", "checkpoint.keep_last=1"]

#: Faults made by :class:`FaultPlugin`: kind -> how the label's note says it was made.
PLUGIN_FAULTS = {
    "broken_verifier": "the verifier grades against the next symbol's answer key (right answers 0)",
    "constant_reward": f"every rollout scores {CONSTANT}",
    "broken_grouping": "every rollout gets its own group id (uid per sample, not per prompt)",
    "reward_hacking": f"a lenient verifier also pays 1 for any completion containing {LOOPHOLE!r}",
}
#: Faults made by a config change at a resume: kind -> (overrides from the fault step on, note).
RESUME_FAULTS = {
    "lr_blowup": ([f"optim.lr={LR * 100:g}"], f"optim.lr x100 ({LR:g} -> {LR * 100:g})"),
    "bf16_mismatch": (["rollout.autocast_bf16=true"], "the sampler in bf16 autocast against the fp32 update"),
    "truncation": (["rollout.max_new_tokens=1"], "rollout.max_new_tokens 4 -> 1 (the end-of-turn token is cut)"),
}
FAILURE_KINDS = (*RESUME_FAULTS, *PLUGIN_FAULTS)
KINDS = (*FAILURE_KINDS, "healthy")

# ---------------------------------------------------------------------------------------------- the labels
LABEL_SOURCES = ("testbed:add/round2", "testbed:add/long", "tiny/failure", "tiny/healthy", "smollm2/meshrl",
                 "smollm2/trl")
LABEL_KINDS = ("healthy", "niche_lost", "lr_blowup", "broken_verifier", "constant_reward", "broken_grouping",
               "bf16_mismatch", "truncation", "reward_hacking")
LABEL_FIELDS = ("id", "source", "engine", "outcome", "kind", "fault_step", "harm_step", "steps", "split", "note")


def check_label(label: dict[str, Any], where: str = "label.json") -> dict[str, Any]:
    """``label`` if it follows the corpus schema, else ``ValueError`` naming ``where`` and the field."""
    missing = [k for k in LABEL_FIELDS if k not in label]
    extra = sorted(set(label) - set(LABEL_FIELDS))
    if missing or extra:
        raise ValueError(f"{where}: missing field(s) {missing}, unknown field(s) {extra}")
    choices = {"source": LABEL_SOURCES, "engine": ("meshrl", "trl"), "outcome": ("harmful", "healthy", "ambiguous"),
               "kind": LABEL_KINDS, "split": ("tune", "report")}
    for name, allowed in choices.items():
        if label[name] not in allowed:
            raise ValueError(f"{where}: {name}={label[name]!r}; allowed: {', '.join(allowed)}")
    for name in ("fault_step", "harm_step", "steps"):
        value = label[name]
        nullable = name != "steps"
        if not ((value is None and nullable) or (isinstance(value, int) and not isinstance(value, bool)
                                                 and value >= (0 if name == "steps" else 1))):
            raise ValueError(f"{where}: {name}={value!r} must be {'null or ' if nullable else ''}an integer "
                             f">= {0 if name == 'steps' else 1}")
    for name in ("id", "note"):
        if not isinstance(label[name], str) or not label[name] or "\n" in label[name]:
            raise ValueError(f"{where}: {name} must be a non-empty one-line string, got {label[name]!r}")
    if label["kind"] == "healthy" and label["fault_step"] is not None:
        raise ValueError(f"{where}: a healthy run has fault_step null, got {label['fault_step']}")
    return label


def harm_step(evals: Sequence[tuple[int, float]], fault_step: int | None, drop: float) -> int | None:
    """The first evaluation step at which the fault's harm shows in held-out accuracy (rule in the module
    docstring); ``evals``: ``(step, accuracy)`` in any order; None when it never shows or there is no fault."""
    if fault_step is None:
        return None
    rows = sorted(evals)
    before = [acc for step, acc in rows if step < fault_step]
    baseline = before[-1] if before else None
    best = float("-inf")
    for step, acc in rows:
        best = max(best, acc)
        # "at least drop below": a float tolerance, so that 0.55 counts as 0.05 below 0.6
        if step >= fault_step and acc <= best - drop + 1e-9 and (baseline is None or acc < baseline):
            return step
    return None


# ---------------------------------------------------------------------------------------------- the faults
@dataclass
class FaultConfig:
    kind: str = setting("", choices=("", *PLUGIN_FAULTS), help="the fault to inject ('' = none)")
    fault_step: int = setting(1, ge=1, help="the first (1-based) step the fault acts on")


class FaultPlugin(Plugin):
    """Changes the step's grading (or grouping) after sampling from ``fault_step`` on; rewards and advantages are
    recomputed with the sampler's own shaping and estimator, so everything downstream sees the faulty values.
    It touches no loss term (no update hook, ``token_level`` False: the update runs as without it)."""

    name = "corpus_fault"
    Config = FaultConfig
    token_level = False
    summary = "a deliberate fault for the doctor's corpus"

    @classmethod
    def is_enabled(cls, cfg: Any) -> bool:
        return bool(cfg.kind)

    def after_sampling(self, step: int, data: Any, sampler: Any) -> Any:
        if step + 1 < self.cfg.fault_step or not len(data):
            return data
        apply_fault(self.cfg.kind, data)
        data.rewards = sampler.scoring.shape_rewards(data)
        data.advantages = sampler.scoring.advantages(data.rewards, data.group_ids)
        return data


def faulty_score(kind: str, completion: str, answer: str, score: float) -> float:
    """The score a faulty verifier of ``kind`` gives a completion the task scored ``score``."""
    from meshrl.tasks.tiny import repeat_reward

    if kind == "broken_verifier":
        return repeat_reward(completion, SYMBOLS[(SYMBOLS.index(answer) + 1) % len(SYMBOLS)])
    if kind == "constant_reward":
        return CONSTANT
    if kind == "reward_hacking":
        return 1.0 if LOOPHOLE in completion else HONEST_WEIGHT * score
    return score


def apply_fault(kind: str, data: Any) -> None:
    """Change one step's :class:`~meshrl.trainer.rollout_step.StepData` in place as fault ``kind`` would."""
    if kind not in PLUGIN_FAULTS:
        raise ValueError(f"plugins.custom kind={kind!r}; known: {', '.join(PLUGIN_FAULTS)}")
    if kind == "broken_grouping":
        data.group_ids = [f"{g}-{i}" for i, g in enumerate(data.group_ids)]
        return
    data.scores = [faulty_score(kind, t, p.answer, s) for t, p, s in zip(data.texts, data.problems, data.scores,
                                                                         strict=True)]
    # The step's sampled accuracy and strategy figures read ``seen``: the faulty verifier graded those too.
    data.seen = [(t, faulty_score(kind, t, p.answer, s), p) for t, s, p in data.seen]
    data.stats["reward/sampled_mean"] = sum(data.scores) / len(data.scores)


# ---------------------------------------------------------------------------------------------- warm start
WARM = {"version": "repeat-warm-v1", "preset": "tiny", "seed": 0, "steps": 600, "batch": 64, "lr": 3e-3,
        "copy_share": 0.5}


def warm_start(root: Path) -> Path:
    """The ``tiny`` model taught ``Repeat: s -> s`` on ``copy_share`` of its examples (a uniform symbol otherwise),
    by teacher forcing; cached in ``root/_warm/<version>`` (written to a temporary directory, then renamed)."""
    target = root / "_warm" / WARM["version"]
    marker = target / "warm.json"
    if marker.is_file():
        if json.loads(marker.read_text())["settings"] != WARM:
            raise ValueError(f"{target} holds a warm start made with other settings; delete it or choose another "
                             "--out")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".warm.", dir=target.parent))
    try:
        t0 = time.perf_counter()
        loss = _teach_copying(tmp)
        (tmp / "warm.json").write_text(json.dumps({"settings": WARM, "final_loss": loss,
                                                   "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _teach_copying(out: Path) -> float:
    from meshrl.models import build_tiny, encode_prompt

    model, tok = build_tiny(WARM["preset"], seed=WARM["seed"])
    rng = random.Random(f"corpus-warm-{WARM['seed']}")
    opt = torch.optim.AdamW(model.parameters(), lr=WARM["lr"])
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(WARM["steps"]):
        rows = []
        for _ in range(WARM["batch"]):
            symbol = rng.choice(SYMBOLS)
            answer = symbol if rng.random() < WARM["copy_share"] else rng.choice(SYMBOLS)
            rows.append((encode_prompt(tok, f"Repeat: {symbol}"),
                         tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]))
        ids, mask, labels = _pad(rows, tok.pad_token_id)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return round(float(loss.detach()), 4)


def _pad(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``; labels are -100 outside the answer."""
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(p) + len(r)] = 1
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
    return ids, mask, labels


# ---------------------------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class RunSpec:
    kind: str  # a failure kind, or "healthy"
    seed: int
    recipe: str = "grpo"
    steps: int = STEPS
    fault_at: int = FAULT_STEP  # failures: the first step the fault acts on

    @property
    def source(self) -> str:
        return "tiny/healthy" if self.kind == "healthy" else "tiny/failure"

    @property
    def run_id(self) -> str:
        return f"{self.source}/{self.recipe if self.kind == 'healthy' else self.kind}/s{self.seed}"

    @property
    def fault_step(self) -> int | None:
        return None if self.kind == "healthy" else self.fault_at

    def overrides(self, model: Path | str) -> list[str]:
        """The ``train`` overrides before the fault step (plug-in faults: for the whole run)."""
        out = [*BASE, f"model={model}", f"seed={self.seed}", f"recipe={self.recipe}", f"steps={self.steps}"]
        if self.kind in PLUGIN_FAULTS:
            out.append(f"plugins.custom=[{{path: '{PLUGIN_PATH}', kind: {self.kind}, fault_step: {self.fault_at}}}]")
        return out

    def resume_overrides(self) -> list[str] | None:
        """The settings changed at the resume before the fault step; None: the run is trained in one segment."""
        return RESUME_FAULTS[self.kind][0] if self.kind in RESUME_FAULTS else None

    def note(self) -> str:
        head = f"model=tiny warm start, tiny:repeat, {self.recipe}, lr {LR:g}, {self.steps} steps, seed {self.seed}"
        if self.kind == "healthy":
            return f"{head}; no fault"
        how = PLUGIN_FAULTS[self.kind] if self.kind in PLUGIN_FAULTS else RESUME_FAULTS[self.kind][1]
        seam = "FaultPlugin" if self.kind in PLUGIN_FAULTS else "config change at a resume"
        return f"{head}; from step {self.fault_at} ({seam}): {how}"


def specs(kinds: Sequence[str], seeds: Sequence[int]) -> list[RunSpec]:
    """The runs of ``kinds`` x ``seeds`` (healthy: one per recipe of :data:`HEALTHY_RECIPES`)."""
    out = []
    for kind in kinds:
        recipes = HEALTHY_RECIPES if kind == "healthy" else ("grpo",)
        out += [RunSpec(kind, seed, recipe) for recipe in recipes for seed in seeds]
    return out


def train_run(spec: RunSpec, path: Path, model: Path | str) -> None:
    """Train ``spec`` into ``path`` (a fresh directory): one segment, or two around a resume."""
    from meshrl.trainer import load_config, train

    base = spec.overrides(model)
    changed = spec.resume_overrides()
    if changed is not None:
        if not 2 <= spec.fault_at <= spec.steps:
            raise ValueError(f"{spec.run_id}: a fault made at a resume needs 2 <= fault step <= steps, got fault "
                             f"step {spec.fault_at} of {spec.steps}")
        train(load_config(overrides=[*base, f"steps={spec.fault_at - 1}"]), path)
        train(load_config(overrides=[*base, *changed]), path, resume=True)
    else:
        train(load_config(overrides=base), path)


def make_label(spec: RunSpec, path: Path) -> dict[str, Any]:
    """``label.json``'s content for the finished run in ``path``."""
    from meshrl.doctor import DEFAULT
    from meshrl.jsonl import read_jsonl

    evals = [(int(r["step"]), float(r["eval/mean@1"])) for r in read_jsonl(path / "evals.jsonl")]
    steps = len(read_jsonl(path / "metrics.jsonl"))
    label = {"id": spec.run_id, "source": spec.source, "engine": "meshrl",
             "outcome": "healthy" if spec.kind == "healthy" else "harmful", "kind": spec.kind,
             "fault_step": spec.fault_step, "harm_step": harm_step(evals, spec.fault_step, DEFAULT.eval_drop_min),
             "steps": steps, "split": "tune" if spec.seed % 2 == 0 else "report", "note": spec.note()}
    return check_label(label, str(path / "label.json"))


def build_run(spec: RunSpec, out: Path, model: Path | str) -> tuple[Path, float | None]:
    """Train and label one run unless its ``label.json`` exists; ``(path, seconds trained or None if reused)``."""
    path = out / spec.run_id
    label_path = path / "label.json"
    if label_path.is_file():
        check_label(json.loads(label_path.read_text()), str(label_path))
        return path, None
    if path.exists():  # an unfinished run: only a directory meshrl made is deleted
        if not is_ours(path, legacy=False):  # the whole directory is deleted: only an empty or marked one
            raise ValueError(f"{path} exists, has no label.json and is not a meshrl run: not deleting it")
        shutil.rmtree(path)
    t0 = time.perf_counter()
    train_run(spec, path, model)
    seconds = time.perf_counter() - t0
    label = make_label(spec, path)
    # The corpus is read from the records; a SmolLM2 checkpoint (weights and AdamW state) is 1.5 GB.
    shutil.rmtree(path / "checkpoints", ignore_errors=True)
    tmp = label_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(label, indent=1) + "\n")
    os.replace(tmp, label_path)  # written last: its presence means the run is complete
    return path, seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.health_corpus.failures",
                                     description="Train the deliberate-failure and healthy tiny runs of the "
                                                 "doctor's corpus, each with label.json (resumable).")
    parser.add_argument("--out", required=True, type=Path, help="corpus directory")
    parser.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS), metavar="KIND",
                        help=f"kinds to build (default: all): {', '.join(KINDS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="seeds (default 0 1 2 3)")
    parser.add_argument("--smollm2", action="store_true",
                        help="instead: the SmolLM2-135M runs (experiments/health_corpus/smollm.py; slow: minutes "
                             "per run); --only and --seeds do not apply")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a shared machine: one thread, and runs reproduce exactly
    if args.smollm2:
        from experiments.health_corpus.smollm import smollm_specs

        todo, model = smollm_specs(args.out), "smollm2-135m"
    else:
        todo, model = specs(args.only, args.seeds), warm_start(args.out)
    for spec in todo:
        path, seconds = build_run(spec, args.out, model)
        label = json.loads((path / "label.json").read_text())
        took = "reused" if seconds is None else f"{seconds:.1f} s"
        print(f"{spec.run_id}: steps {label['steps']}, harm_step {label['harm_step']} ({took})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
