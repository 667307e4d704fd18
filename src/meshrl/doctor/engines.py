"""Engine adapters: TRL and verl runs read into :class:`~meshrl.doctor.records.RunRecords`.

Each engine's metric names are mapped to meshrl's explicitly (``TRL_NAMES``, ``VERL_NAMES``); a name that
is not in the map is kept under its own name (so it shows in ``--json``) and never guessed at. Sources:

- TRL 1.16 ``GRPOTrainer`` (``trl/trainer/grpo_trainer.py``, the keys of ``self._metrics``) plus the
  transformers ``Trainer`` keys ``loss``, ``grad_norm``, ``learning_rate``, ``epoch``. They reach
  ``trainer_state.json``'s ``log_history`` as they are (evaluation entries as ``eval_<name>``) and TensorBoard
  through transformers' callback with a ``train/`` or ``eval/`` prefix.
- TRL 1.16 ``AsyncGRPOTrainer`` (``trl/experimental/async_grpo/async_grpo_trainer.py``), recognised from its records
  (:func:`is_async_grpo`) and read through ``TRL_ASYNC_NAMES`` over ``TRL_NAMES``: its ``kl`` is the k3 estimate
  against the sampler's log-probs (``mismatch/kl``, not KL to a reference), its ``sample/staleness_*`` are the lag
  (``lag/*``), a reward function's mean is ``rewards/<name>`` (``TRL_ASYNC_ACCURACY``), and its loss, a clipped
  ratio against the sampler's log-probs, is the lag's correction (``config["staleness_correction"]``).
- verl 0.9 (``verl/trainer/ppo/metric_utils.py::compute_data_metrics``, the actor's update metrics, the
  rollout-correction diagnostics ``rollout_corr/*`` and ``training/rollout_probs_diff_*``), logged by its
  ``Tracking`` class: the ``file`` backend writes one JSON object per step to ``VERL_FILE_LOGGER_PATH``
  (``{"step": N, "data": {...}}``, flat objects are accepted too), the ``tensorboard`` backend the same keys
  as tags. Validation keys ``val-core/<data source>/<variable>/<stat>@N`` become held-out records.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from meshrl.doctor.completions import trl_completions, verl_dumps
from meshrl.doctor.records import RunRecords, by_step, number, read_jsonl
from meshrl.doctor.tfevents import event_files, read_scalars

TRL_NAMES: dict[str, str] = {
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "frac_reward_zero_std": "group/flat_frac",
    "entropy": "entropy/mean",
    "kl": "kl/mean",
    "grad_norm": "grad/norm",
    "learning_rate": "lr",
    "loss": "loss/total",
    "policy_loss": "loss/policy",
    "completions/mean_length": "len/response_mean",
    "completions/max_length": "len/response_max",
    "completions/min_length": "len/response_min",
    "completions/clipped_ratio": "len/truncated_frac",
    "clip_ratio/region_mean": "clip/frac",
    "clip_ratio/low_mean": "clip/frac_low",
    "clip_ratio/high_mean": "clip/frac_high",
    "sampling/sampling_logp_difference/mean": "mismatch/logp_diff_mean",
    "sampling/sampling_logp_difference/max": "mismatch/logp_diff_max",
    "sampling/importance_sampling_ratio/max": "mismatch/is_ratio_max",
    "sampling/importance_sampling_ratio/mean": "mismatch/is_ratio_mean",
    "num_tokens": "rollouts/tokens",
}
#: The settings the checks use: meshrl's name -> the TrainingArguments / GRPOConfig field (training_args.json).
TRL_SETTINGS: dict[str, str] = {"max_new_tokens": "max_completion_length", "group_size": "num_generations",
                                "lr": "learning_rate", "warmup_steps": "warmup_steps", "steps": "max_steps"}
# TRL logs one mean per reward function; one whose name says accuracy / correctness is the accuracy.
TRL_ACCURACY = re.compile(r"^rewards/([^/]*(?:acc|correct)[^/]*)/mean$", re.IGNORECASE)

#: AsyncGRPOTrainer's names where they differ from GRPOTrainer's (``TRL_NAMES`` holds the rest). Its ``kl`` is
#: ``mean((r - 1) - log r)`` with ``r = pi_train / pi_sampler`` on the sampled tokens (``compute_loss``): the k3
#: estimate of KL(sampler || trainer), as verl's ``rollout_corr/kl``, holding the policy's drift over the samples'
#: staleness as well as the trainer/server mismatch; the trainer has no reference model and no KL term.
#: ``sample/staleness_*``: weight versions between the sampler's and the trainer's at consumption (optimiser steps
#: with ``weight_sync_steps=1``, the default), reduced per logged step as a mean and a max.
TRL_ASYNC_NAMES: dict[str, str] = {
    "kl": "mismatch/kl",
    "sample/staleness_mean": "lag/staleness_mean",
    "sample/staleness_max": "lag/staleness_max",
}
#: AsyncGRPOTrainer logs a reward function's mean over the step's samples as ``rewards/<name>`` (no ``/mean``).
TRL_ASYNC_ACCURACY = re.compile(r"^rewards/([^/]*(?:acc|correct)[^/]*)$", re.IGNORECASE)
#: Keys of AsyncGRPOTrainer's sample stream (``RolloutQueueDataset.__iter__``), which GRPOTrainer never logs; the
#: asynchronous distillation trainer logs them too, but not the clipped-ratio loss's figures of ``TRL_ASYNC_LOSS``.
TRL_ASYNC_SAMPLE_KEYS = ("sample/staleness_mean", "sample/staleness_max", "sample/time_in_queue_s",
                         "sample/rollout_queue_size", "sample/dropped_stale_total")
TRL_ASYNC_LOSS = ("kl", "ratio", "clip_ratio/region_mean")
#: What corrects AsyncGRPOTrainer's lag (``RunRecords.config["staleness_correction"]``, read by ``stale_rollouts``).
TRL_ASYNC_CORRECTION = "clipped ratio to the sampler's log-probs (TRL AsyncGRPOTrainer)"

VERL_NAMES: dict[str, str] = {
    "critic/score/mean": "reward/mean",  # the verifier's sequence score (before any KL penalty)
    "critic/rewards/mean": "reward/shaped_mean",
    "actor/entropy": "entropy/mean",
    "actor/kl_loss": "kl/mean",  # KL to the reference policy (use_kl_loss)
    "actor/ppo_kl": "ratio/log_mean",  # mean log-ratio between the update's policy and the rollout's old policy
    "actor/grad_norm": "grad/norm",
    "actor/lr": "lr",
    "actor/pg_loss": "loss/policy",
    "actor/pg_clipfrac": "clip/frac_high",
    "actor/pg_clipfrac_lower": "clip/frac_low",
    "response_length/mean": "len/response_mean",
    "response_length/max": "len/response_max",
    "response_length/min": "len/response_min",
    "response_length/clip_ratio": "len/truncated_frac",
    "training/rollout_probs_diff_mean": "mismatch/prob_diff_mean",
    "training/rollout_probs_diff_max": "mismatch/prob_diff_max",
    "rollout_corr/kl": "mismatch/kl",
    "rollout_corr/log_ppl_abs_diff": "mismatch/log_ppl_abs_diff",
    "rollout_corr/rollout_is_max": "mismatch/is_ratio_max",
    "rollout_corr/rollout_is_mean": "mismatch/is_ratio_mean",
}
VERL_VAL = re.compile(r"^val-core/(?P<source>[^/]+)/(?P<var>[^/]+)/(?P<stat>.+)$")


def _rename(row: dict[str, Any], names: dict[str, str], used: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in row.items():
        new = names.get(k, k)
        if new != k:
            used[k] = new
        out[new] = v
    return out


def _clip_total(steps: list[dict[str, float]]) -> None:
    for r in steps:
        if "clip/frac" not in r and ("clip/frac_low" in r or "clip/frac_high" in r):
            r["clip/frac"] = r.get("clip/frac_low", 0.0) + r.get("clip/frac_high", 0.0)


def _tensorboard_rows(root: Path, notes: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in event_files(root):
        rows += [{"step": ev.step, ev.tag: ev.value} for ev in read_scalars(path, notes)]
    return rows


# ---------------------------------------------------------------------- TRL
def _trl_state(root: Path) -> Path | None:
    """``trainer_state.json`` at the top, else the one of the latest ``checkpoint-N`` folder."""
    if (root / "trainer_state.json").is_file():
        return root / "trainer_state.json"
    ckpts = sorted(root.glob("checkpoint-*/trainer_state.json"),
                   key=lambda p: int(p.parent.name.split("-")[-1]) if p.parent.name.split("-")[-1].isdigit() else -1)
    return ckpts[-1] if ckpts else None


def is_async_grpo(history: list[dict[str, Any]]) -> bool:
    """Whether ``log_history`` entries are AsyncGRPOTrainer's: a key of its sample stream and one of its loss's."""
    keys = {k for row in history for k in row}
    return bool(keys & set(TRL_ASYNC_SAMPLE_KEYS)) and bool(keys & set(TRL_ASYNC_LOSS))


def _trl_row(row: dict[str, Any], used: dict[str, str], *, names: dict[str, str] = TRL_NAMES,
             accuracy: re.Pattern[str] = TRL_ACCURACY) -> tuple[dict[str, Any], dict[str, Any]]:
    """(training metrics, held-out metrics) of one log entry, in meshrl names."""
    train, held = {"step": row.get("step")}, {"step": row.get("step")}
    for k, v in row.items():
        if k == "step":
            continue
        if k.startswith("eval_"):
            held[f"eval/{k.removeprefix('eval_')}"] = v
            continue
        acc = accuracy.match(k)
        if acc:
            used[k] = "acc/mean"
            train["acc/mean"] = v
        train.update(_rename({k: v}, names, used))
    return train, held


def _trl_async_row(row: dict[str, Any], used: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    return _trl_row(row, used, names={**TRL_NAMES, **TRL_ASYNC_NAMES}, accuracy=TRL_ASYNC_ACCURACY)


def load_trl(root: Path) -> RunRecords:
    """A TRL output directory: ``trainer_state.json`` (or the latest checkpoint's) and/or TensorBoard events
    (tags ``train/<name>``, ``eval/<name>``). ``ValueError`` when neither exists."""
    notes: list[str] = []
    config: dict[str, Any] = {}
    state_path = _trl_state(root)
    history: list[dict[str, Any]] = []
    if state_path is not None:
        history, config["steps"] = _trl_history(state_path, notes)
    tb = _tensorboard_rows(root, notes)
    if state_path is None and not tb:
        raise ValueError(f"{root}: no trainer_state.json and no TensorBoard event files (not a TRL run?)")
    if state_path is None:
        history = _tensorboard_history(tb)
    elif tb:
        notes.append("TensorBoard events present too: trainer_state.json was read (the same values)")
    _read_trl_args(root, config, notes)
    return trl_records(root, history, config, notes, samples=trl_completions(root, notes))


def _tensorboard_history(tb: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TensorBoard rows (``train/<name>``, ``eval/<name>`` tags) as ``log_history`` entries."""
    rows = []
    for row in tb:
        for tag, v in row.items():
            if tag != "step":
                name = f"eval_{tag.removeprefix('eval/')}" if tag.startswith("eval/") else tag.removeprefix("train/")
                rows.append({"step": row["step"], name: v})
    return rows


def trl_records(root: Path, history: list[dict[str, Any]], config: dict[str, Any],
                notes: list[str], samples: list[dict[str, Any]] | None = None) -> RunRecords:
    """:class:`RunRecords` of TRL ``log_history`` entries (meshrl's names; ``eval_*`` keys become held-out
    records). Used by the post-hoc reader and by the live callback on ``TrainerState.log_history``. Entries of an
    AsyncGRPOTrainer run (:func:`is_async_grpo`) are read with its names, and the run's config says what corrects
    its lag."""
    if not is_async_grpo(history):
        return _engine_records(root, "trl", history, _trl_row, config, notes, samples)
    notes = [*notes, "AsyncGRPOTrainer records: its kl (k3 against the sampler's log-probs) is read as mismatch/kl, "
             "which holds the policy's drift over the samples' staleness as well as the trainer/server mismatch "
             "(a rollout_mismatch there may call for a lower max_staleness); sample/staleness_* as lag/*, corrected "
             "by the loss's clipped ratio to the sampler's log-probs"]
    config = {**config, "staleness_correction": TRL_ASYNC_CORRECTION}
    return _engine_records(root, "trl", history, _trl_async_row, config, notes, samples)


def _engine_records(root: Path, engine: str, rows: list[dict[str, Any]], split: Any, config: dict[str, Any],
                    notes: list[str], samples: list[dict[str, Any]] | None) -> RunRecords:
    """:class:`RunRecords` of an engine's log rows; ``split(row, used)`` gives (training metrics, held-out
    metrics) of a row in meshrl's names and records the names it mapped in ``used``."""
    used: dict[str, str] = {}
    train_rows, held_rows = [], []
    for row in rows:
        t, h = split(row, used)
        train_rows.append(t)
        if len(h) > 1:
            held_rows.append(h)
    steps = [r for r in by_step(train_rows) if len(r) > 1]
    _clip_total(steps)
    return RunRecords(path=root, engine=engine, steps=steps, evals=[r for r in by_step(held_rows) if len(r) > 1],
                      samples=samples or [], config=config, notes=notes, mapping=used)


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(number(value) or 0.0)


def _read_json(path: Path) -> Any:
    """The JSON value in ``path``; ``ValueError`` naming the file when it is unreadable or not JSON."""
    try:
        return json.loads(path.read_bytes().decode("utf-8-sig"))
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {e.lineno}: not valid JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:  # an integer over the int string limit; nesting too deep
        raise ValueError(f"{path}: not valid JSON ({str(e).split(';')[0]})") from None


def _trl_history(path: Path, notes: list[str]) -> tuple[list[dict[str, Any]], int | None]:
    """(the ``log_history`` entries that are objects, ``max_steps``) of a ``trainer_state.json``. A state
    that is not an object or whose ``log_history`` is not a list is refused naming the file and field; an
    entry that is not an object is skipped and counted in ``notes``."""
    state = _read_json(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a JSON object (a TRL trainer_state.json), got {type(state).__name__}")
    history = state.get("log_history")
    if not isinstance(history, list):
        raise ValueError(f"{path}: field 'log_history' must be a list of log entries, got "
                         f"{type(history).__name__}")
    rows = [row for row in history if isinstance(row, dict)]
    if len(rows) < len(history):
        first = next(i for i, row in enumerate(history) if not isinstance(row, dict))
        notes.append(f"{path.name}: skipped {len(history) - len(rows)} log_history entr(y/ies) that are not "
                     f"objects (first: entry {first}, a {type(history[first]).__name__})")
    max_steps = state.get("max_steps")
    return rows, max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) else None


def _read_trl_args(root: Path, config: dict[str, Any], notes: list[str]) -> None:
    """Settings from a ``training_args.json`` / ``config.json`` if the user saved one (TRL keeps
    ``training_args.bin``, a pickle, which is not read)."""
    for name in ("training_args.json", "grpo_config.json"):
        path = root / name
        if path.is_file():
            try:
                args = _read_json(path)
            except ValueError as e:
                notes.append(f"{e}: settings not read")
                continue
            if not isinstance(args, dict):
                notes.append(f"{path}: expected a JSON object of training arguments, got {type(args).__name__}; "
                             "settings not read")
                continue
            for ours, theirs in TRL_SETTINGS.items():
                value = args.get(theirs)
                if value is not None and not _finite_number(value):
                    notes.append(f"{path.name}: field {theirs!r} is not a finite number ({str(value)[:40]!r}); "
                                 "not used")
                    value = None
                if value is not None or ours != "steps":
                    config[ours] = value
            return
    notes.append("no training_args.json: max_completion_length, num_generations and the learning rate are unknown")


# ---------------------------------------------------------------------- verl
#: lines of a JSONL file read to recognise a verl log (a damaged first line does not hide it)
VERL_PROBE_LINES = 20


def _is_verl_line(line: str) -> bool:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, an integer over the int string limit, nested too deep
        return False
    body = obj.get("data", obj) if isinstance(obj, dict) else {}
    return isinstance(body, dict) and any(str(k).split("/")[0] in ("critic", "actor", "response_length", "val-core")
                                          for k in body)


def _verl_jsonl(root: Path) -> list[Path]:
    files = [root] if root.is_file() else sorted(root.glob("*.jsonl"))
    out = []
    for path in files:
        with path.open(errors="replace") as fh:
            lines = [ln for _, ln in zip(range(VERL_PROBE_LINES), (ln for ln in fh if ln.strip()), strict=False)]
        if any(_is_verl_line(ln) for ln in lines):
            out.append(path)
    return out


def _verl_row(obj: dict[str, Any], used: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    body = obj["data"] if isinstance(obj.get("data"), dict) else obj
    step = obj.get("step", body.get("step"))
    train, held = {"step": step}, {"step": step}
    for k, v in body.items():
        val = VERL_VAL.match(k)
        if val:
            held[f"eval/{val['source']}/{val['var']}/{val['stat']}"] = v
        elif k != "step":
            train.update(_rename({k: v}, VERL_NAMES, used))
    return train, held


def load_verl(root: Path, samples: Path | None = None) -> RunRecords:
    """A verl run: the file logger's JSONL (a file, or a directory holding it) and/or TensorBoard events;
    ``samples``: verl's generation dumps (``trainer.rollout_data_dir``). ``ValueError`` when neither log is found."""
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    for path in _verl_jsonl(root):
        rows += read_jsonl(path, notes)
    if not rows and root.is_dir():
        rows = _tensorboard_rows(root, notes)
    if not rows:
        raise ValueError(f"{root}: no verl file-logger JSONL and no TensorBoard event files (not a verl run?)")
    return verl_records(root, rows, notes, samples=verl_dumps(samples, notes) if samples else None)


def verl_records(root: Path, rows: list[dict[str, Any]], notes: list[str],
                 samples: list[dict[str, Any]] | None = None) -> RunRecords:
    """:class:`RunRecords` of verl metric rows (``{"step": N, "data": {...}}`` or flat), in meshrl's names. Used by
    the post-hoc reader and by the live hook of meshrl's verl trainer."""
    notes = [*notes, "verl logs no per-group figures: grouping is checked only through the advantage statistics"]
    return _engine_records(root, "verl", rows, _verl_row, {}, notes, samples)


def detect_engine(root: Path) -> str:
    """``meshrl``, ``trl`` or ``verl`` from what the directory (or file) holds; ``ValueError`` otherwise."""
    from meshrl.doctor.records import is_meshrl_run

    if root.is_dir() and is_meshrl_run(root):
        return "meshrl"
    if root.is_dir() and _trl_state(root) is not None:
        return "trl"
    if _verl_jsonl(root):
        return "verl"
    if root.is_dir():
        for path in event_files(root)[:1]:
            tags = {ev.tag for ev in read_scalars(path, [])}
            if any(t.startswith(("train/", "eval/")) for t in tags):
                return "trl"
            if any(t.split("/")[0] in ("critic", "actor", "response_length") for t in tags):
                return "verl"
    raise ValueError(f"{root}: not a meshrl run (config.yaml + metrics.jsonl), a TRL output directory "
                     "(trainer_state.json / TensorBoard train/* tags) or a verl log (file-logger JSONL / "
                     "TensorBoard critic/*, actor/* tags)")


def load_run(root: str | Path, engine: str = "auto", *, samples: str | Path | None = None) -> RunRecords:
    """Read a run of any supported engine (``engine``: ``auto``, ``meshrl``, ``trl``, ``verl``); ``samples``: a
    verl run's generation dumps (``trainer.rollout_data_dir``; TRL's ``completions/`` folder is found by itself)."""
    from meshrl.doctor.records import load_meshrl

    path = Path(root)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    kind = detect_engine(path) if engine == "auto" else engine
    loaders = {"meshrl": load_meshrl, "trl": load_trl, "verl": load_verl}
    if kind not in loaders:
        raise ValueError(f"unknown engine {engine!r}; known: auto, {', '.join(loaders)}")
    if samples is not None and kind != "verl":
        raise ValueError(f"--samples is for verl's generation dumps; a {kind} run's completions are found in the "
                         "run directory")
    if samples is not None and not Path(samples).is_dir():
        raise ValueError(f"--samples {samples}: not a directory (verl's trainer.rollout_data_dir)")
    rec = load_verl(path, Path(samples)) if samples is not None else loaders[kind](path)
    if not rec.steps:
        skipped = "; ".join(n for n in rec.notes if "skipped" in n)  # why nothing was left, when lines were bad
        raise ValueError(f"{path}: no per-step metrics found ({kind} run{'; ' + skipped if skipped else ''})")
    return rec
