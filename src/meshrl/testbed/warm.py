"""The testbed's warm start: a small built-in model taught all three procedures, cached on disk.

``warm_start()`` trains ``meshrl.models.build_tiny(preset)`` by teacher forcing (AdamW, seeded) on
reference traces of ``testbed:add`` problems drawn from the *train* pair pool (never an eval pair, for
any task seed). Each example's procedure is drawn uniformly and independently of the problem type, so
the starting policy uses every procedure on every type and the three genuinely compete: RL has to find
out which one works where. Over-budget traces (column addition on a ``carry`` problem) are taught too:
the procedure exists, it just does not finish within the budget.

A few extra examples (``coach_fraction`` per plain example) carry a rule-coach prefix in the system
prompt, with the trace of the procedure the prefix describes. Without them the tiny model has never seen
a system prompt and ignores coach prefixes (it writes garbage under them), so Coach Prompting could not be
studied on it. Two forms (``coach_templates``, see :func:`coach_system_prompt`):

* ``plain`` (default): the prefix text alone as the system prompt (about 110 characters). 2,300 such
  examples cost about 15 s and the model then follows the prefix in 99% of rollouts.
* ``wrapped``: ``meshrl.mesh.wrap_prefix(text, "system")``, the anti-hacking template the ``mesh`` and
  ``cp_only`` recipes use today (about 820 characters, 35 times a plain prompt). Learning to follow it
  takes about 2,000 examples (``coach_fraction=0.05``), which adds about 3 minutes on 2 CPU cores.

The result is saved with ``save_pretrained`` (model and tokenizer) into a directory that
``meshrl.models.load_model`` and ``meshrl train --model PATH`` accept. The directory is named after a
hash of every setting that changes the weights, written atomically (temporary directory + rename) and
reused on the next call.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from meshrl.testbed.audit import AUDIT_BUDGET, AUDIT_PRIOR, parse_audit_mix, sample_audit_problems
from meshrl.testbed.task import COACH_TEXT, COACH_VARIANTS, DEFAULT_BUDGET, parse_mix, sample_problems
from meshrl.testbed.traces import STRATEGIES, reference_trace

WARM_VERSION = "testbed-add-warm-v2"  # bump when data, format or training loop change the weights
MARKER = "warm_start.json"
#: Warm starts shipped with the package (the demo's: ``meshrl demo`` then needs no 3-8 minute warm start, and every
#: machine starts from the same weights). ``scripts/ship_warm_start.py`` rebuilds them when the settings change.
SHIPPED = Path(__file__).parent / "shipped"
DEFAULT_STEPS = 700
COACH_TEMPLATES = ("wrapped", "plain")
#: task family -> (problem sampler, mix parser, procedure prior or None = uniform, budget)
FAMILIES: dict[str, tuple[Any, Any, dict[str, float] | None, int]] = {
    "testbed:add": (sample_problems, parse_mix, None, DEFAULT_BUDGET),
    "testbed:audit": (sample_audit_problems, parse_audit_mix, AUDIT_PRIOR, AUDIT_BUDGET),
}


def coach_system_prompt(text: str, template: str) -> str:
    """The system prompt a coach prefix becomes: ``wrapped`` = ``meshrl.mesh.wrap_prefix(text, "system")``
    (what the ``mesh``/``cp_only`` recipes feed the model), ``plain`` = the prefix text alone."""
    if template == "wrapped":
        from meshrl.mesh import wrap_prefix

        return wrap_prefix(text, "system")
    if template == "plain":
        return text
    raise ValueError(f"unknown coach template {template!r}; known: {', '.join(COACH_TEMPLATES)}")


def cache_root() -> Path:
    """``$MESHRL_CACHE/testbed`` or ``~/.cache/meshrl/testbed``."""
    env = os.environ.get("MESHRL_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "meshrl"
    return base / "testbed"


def warm_settings(*, seed: int, steps: int, preset: str, batch_size: int, lr: float, coach_fraction: float,
                  coach_templates: tuple[str, ...] = ("plain",), mix: Any = None, task: str = "testbed:add",
                  coach_variants: bool = False) -> dict[str, Any]:
    """Everything that determines the warm-start weights (and names the cache directory).

    Keys that only a non-default family or option needs (``prior``, ``coach_variants``) are left out at
    their defaults, so the default warm start keeps its cache name and its weights."""
    if task not in FAMILIES:
        raise ValueError(f"warm start: unknown task family {task!r}; known: {', '.join(FAMILIES)}")
    _, mix_parser, prior, budget = FAMILIES[task]
    settings = {"version": WARM_VERSION, "task": task, "budget": budget, "seed": int(seed),
                "steps": int(steps), "preset": preset, "batch_size": int(batch_size), "lr": float(lr),
                "coach_fraction": float(coach_fraction), "coach_templates": list(coach_templates),
                "mix": mix_parser(mix), "coach_text": dict(COACH_TEXT)}
    if prior is not None:
        settings["prior"] = dict(prior)
    if coach_variants:
        settings["coach_variants"] = {s: list(v) for s, v in COACH_VARIANTS.items()}
    return settings


def settings_hash(settings: dict[str, Any]) -> str:
    """A short stable hash of ``settings``."""
    blob = json.dumps(settings, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def warm_start(out_dir: str | os.PathLike | None = None, *, seed: int = 0, steps: int = DEFAULT_STEPS,
               preset: str = "tiny:small", force: bool = False, batch_size: int = 64, lr: float = 3e-3,
               coach_fraction: float = 0.06, coach_templates: tuple[str, ...] = ("plain",), mix: Any = None,
               threads: int | None = None, progress: bool = True, task: str = "testbed:add",
               coach_variants: bool = False) -> Path:
    """Return the directory of a warm-started testbed model, training it first if it is not cached.

    Args:
        out_dir: where to put the model; default: the copy shipped with the package when it was made with these
            settings (:data:`SHIPPED`), else ``cache_root() / f"warm_{hash}"``. An existing complete
            directory made with the same settings is reused (a different one raises ``ValueError``).
        seed: model init, data order and procedure draws (same seed and settings -> same weights).
        steps: optimiser steps of ``batch_size`` examples.
        preset: a ``meshrl.models.TINY_PRESETS`` name.
        force: retrain even if a cached or shipped copy exists (a cached one is replaced atomically; the
            shipped one, :data:`SHIPPED`, is never written).
        lr: peak AdamW learning rate (see :func:`lr_at` for the schedule).
        coach_fraction: coach-prefixed examples per plain example (0 turns them off); they are extra.
        coach_templates: system-prompt forms of the coach examples, each drawn uniformly
            (:func:`coach_system_prompt`; ``wrapped`` is what the trainer's Mesh recipes use).
        mix: problem-type weights of the training data (default: the task's).
        threads: ``torch.set_num_threads`` during training (default ``min(4, cpu count)``; restored).
        progress: show progress on stderr (a rich bar on a terminal, plain lines otherwise).
        task: the task family (``FAMILIES``): ``testbed:add`` (procedures drawn uniformly) or
            ``testbed:audit`` (drawn from ``AUDIT_PRIOR``, which makes ``c`` rare).
        coach_variants: teach every phrasing of ``COACH_VARIANTS`` in the coach examples (drawn
            uniformly), not only ``COACH_TEXT``: what the applicable-strategy coach's repeats need.
    """
    if steps < 0 or batch_size < 1 or not 0 <= coach_fraction < 1 or lr <= 0:
        raise ValueError(f"bad warm-start settings: steps={steps}, batch_size={batch_size}, lr={lr}, "
                         f"coach_fraction={coach_fraction}")
    bad = sorted(set(coach_templates) - set(COACH_TEMPLATES))
    if bad or not coach_templates:
        raise ValueError(f"coach_templates must be a non-empty subset of {COACH_TEMPLATES}, got {coach_templates}")
    settings = warm_settings(seed=seed, steps=steps, preset=preset, batch_size=batch_size, lr=lr,
                             coach_fraction=coach_fraction, coach_templates=tuple(coach_templates), mix=mix,
                             task=task, coach_variants=coach_variants)
    name = f"warm_{settings_hash(settings)}"
    if out_dir is None and not force and _complete(SHIPPED / name, settings):
        return SHIPPED / name  # made with exactly these settings, shipped with the package
    target = Path(out_dir).expanduser() if out_dir is not None else cache_root() / name
    return build_cached(target, settings, lambda out: _train(out, settings, threads=threads, progress=progress),
                        force=force)


def build_cached(target: Path, settings: dict[str, Any], train_into: Any, *, force: bool) -> Path:
    """``target`` when it holds a warm start made with ``settings`` (and not ``force``); else ``train_into(tmp)``
    (returns the training figures) in a temporary directory beside it, the marker written, published atomically."""
    if not force and _complete(target, settings):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        info = train_into(tmp)
        (tmp / MARKER).write_text(json.dumps({"settings": settings, **info}, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is for every user of the machine
        _publish(tmp, target, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def warm_info(path: str | os.PathLike) -> dict[str, Any]:
    """The settings and training figures recorded next to a warm-start model."""
    return json.loads((Path(path) / MARKER).read_text())


def _complete(target: Path, settings: dict[str, Any]) -> bool:
    marker = target / MARKER
    if not marker.is_file():
        if target.exists() and any(target.iterdir()):
            raise ValueError(f"{target} exists and is not a testbed warm start; choose another out_dir")
        return False
    found = json.loads(marker.read_text()).get("settings")
    if found != settings:
        raise ValueError(f"{target} holds a warm start made with other settings ({found}); "
                         "use force=True to replace it or another out_dir")
    return True


def _publish(tmp: Path, target: Path, *, force: bool) -> None:
    """Move ``tmp`` to ``target`` atomically; a concurrent writer that finished first wins."""
    if target.exists():
        if not force:
            return  # someone else published the same settings meanwhile
        old = target.with_name(f".{target.name}.old.{os.getpid()}")
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        if not (target / MARKER).is_file():
            raise


# ----------------------------------------------------------------------------------------- training
def _train(out: Path, settings: dict[str, Any], *, threads: int | None, progress: bool) -> dict[str, Any]:
    from meshrl.models import build_tiny

    return train_and_save(out, settings, lambda: build_tiny(settings["preset"], seed=settings["seed"]), _Examples,
                          threads=threads, progress=progress)


def train_and_save(out: Path, settings: dict[str, Any], make_model: Any, make_examples: Any, *,
                   threads: int | None, progress: bool) -> dict[str, Any]:
    """Teacher-force ``make_model()``'s ``(model, tokenizer)`` on ``make_examples(tokenizer, settings)`` with
    :func:`_optimise`, save both into ``out``; the figures recorded beside the weights (time, threads, loss)."""
    old_threads = torch.get_num_threads()
    n_threads = threads or min(4, os.cpu_count() or 1)
    torch.set_num_threads(n_threads)
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        model, tok = make_model()
        losses = _optimise(model, make_examples(tok, settings), settings, progress=progress)
        model.eval()
        model.save_pretrained(out)
        tok.save_pretrained(out)
    finally:
        torch.set_num_threads(old_threads)
    tail = losses[-max(1, len(losses) // 10):]
    return {"seconds": round(time.perf_counter() - t0, 2), "cpu_seconds": round(time.process_time() - cpu0, 2),
            "threads": n_threads, "params": sum(p.numel() for p in model.parameters()),
            "final_loss": round(sum(tail) / len(tail), 5) if tail else None}


class _Examples:
    """Seeded stream of teacher-forcing batches: plain prompts and (a few) coach-prefixed ones."""

    def __init__(self, tok, settings: dict[str, Any]) -> None:
        from meshrl.models import encode_prompt

        self.tok, self.encode = tok, encode_prompt
        self.rng = random.Random(f"testbed-warm-{settings['seed']}")
        self.mix = settings["mix"]
        self.batch = settings["batch_size"]
        self.per_step = settings["batch_size"] * settings["coach_fraction"]  # coach examples per step, on average
        self.templates = list(settings["coach_templates"])
        self.sample, _, _, _ = FAMILIES[settings.get("task", "testbed:add")]
        self.prior = [settings["prior"][s] for s in STRATEGIES] if "prior" in settings else None
        texts = settings.get("coach_variants") or {s: [COACH_TEXT[s]] for s in STRATEGIES}
        self.systems = {(s, t): [coach_system_prompt(x, t) for x in texts[s]]
                        for s in STRATEGIES for t in self.templates}
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos

    def _rows(self, n: int, template: str | None) -> list[tuple[list[int], list[int]]]:
        rows = []
        for problem in self.sample(n, self.mix, self.rng, held_out=False):
            # draws only where a setting asks for them, so the default stream (and its weights) is unchanged
            strategy = self.rng.choice(STRATEGIES) if self.prior is None else \
                self.rng.choices(STRATEGIES, weights=self.prior)[0]
            system = None
            if template:
                options = self.systems[strategy, template]
                system = options[0] if len(options) == 1 else self.rng.choice(options)
            prompt = self.encode(self.tok, problem.prompt, system=system)
            trace = reference_trace(problem.meta["a"], problem.meta["b"], strategy)
            rows.append((prompt, self.tok.encode(trace, add_special_tokens=False) + [self.eos]))
        return rows

    def next(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Padded ``(input_ids, attention_mask, labels)`` micro-batches of step ``step`` (labels -100 off-response).

        Every step has ``batch_size`` plain examples; coach-prefixed ones come on top, spread evenly over
        the steps (``floor((step + 1) q) - floor(step q)`` of them, ``q = batch_size * coach_fraction``),
        each with a template drawn from ``coach_templates``, in one micro-batch per template (a wrapped
        prompt is twenty times longer than a plain one).
        """
        n_coach = math.floor((step + 1) * self.per_step + 1e-9) - math.floor(step * self.per_step + 1e-9)
        parts = [self._rows(self.batch, None)]
        drawn = [self.rng.choice(self.templates) for _ in range(n_coach)]
        parts += [self._rows(drawn.count(t), t) for t in self.templates if t in drawn]
        return [self._pad(rows) for rows in parts]

    def _pad(self, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (p, r) in enumerate(rows):
            seq = p + r
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            labels[i, len(p) : len(seq)] = torch.tensor(r)
        return ids, mask, labels


def lr_at(step: int, steps: int, peak: float) -> float:
    """Warm-up, stable, decay: linear warm-up over 5% of the steps, ``peak`` until 75%, then a linear
    decay to ``0.1 * peak`` (a short run learns more at a constant rate than under a cosine)."""
    warm, decay = max(1, steps // 20), int(0.75 * steps)
    if step < warm:
        return peak * (step + 1) / warm
    if step < decay:
        return peak
    return peak * (1 - 0.9 * (step - decay) / max(1, steps - decay))


def _optimise(model, data: _Examples, settings: dict[str, Any], *, progress: bool) -> list[float]:
    steps, peak = settings["steps"], settings["lr"]
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    losses: list[float] = []
    from meshrl.progress import progress_bar

    with progress_bar("testbed warm start", steps, progress and steps > 0) as advance:
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, peak)
            batches = data.next(step)
            n_tokens = sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in batches)
            total = 0.0
            for ids, mask, labels in batches:
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                target = labels[:, 1:]
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
                ) / n_tokens
                loss.backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
            advance(description=f"loss {total:.3f}")
    return losses
