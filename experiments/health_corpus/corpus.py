"""The doctor's labelled corpus: runs with a ``label.json``, and collapse-testbed runs labelled from their
checkpoint evaluations.

A corpus run is any run directory the doctor reads plus ``label.json`` (fields below, :data:`LABEL_FIELDS`).
Testbed runs (``experiments.collapse_testbed``, an experiment directory ``runs/ARM/seed_S`` or its pack) carry no
label file: :func:`testbed_runs` labels each finished run from its checkpoint evaluations
(``ckpt_eval/step_N/eval.json``) on the task's headline niche (``decade`` for ``testbed:add``):

- ``harmful`` when the niche's held-out accuracy (pass@1 = c/n) fell below ``NICHE_FALL_AT`` (0.1, the fall a lost
  seed goes through, ``experiments.collapse_testbed.results``) at some checkpoint; ``harm_step`` = the first such
  checkpoint's step;
- ``healthy`` when it never did and the final accuracy there (``eval/eval.json``, else the last checkpoint) is at
  least the experiment's ``niche_kept_at`` (0.5: "kept");
- ``ambiguous`` otherwise (never below 0.1, not kept at the end): counted, left out of every rate.

A testbed label also says whether a harmful run ``recovered`` (kept at the end after the fall): on 120-step runs
the niche often falls below 0.1 early and comes back, so "fell" is not "lost".

Split: even seeds ``tune``, odd seeds ``report``. The testbed runs are read without their training samples (a
pack has none), so the sample-based checks say "not checked" on them. Their checkpoint evaluations are attached
as held-out eval records at their step (``eval/mean@1`` ..., as a run with ``eval.every`` = the checkpoint
interval logs them) unless ``attach_evals=False``: the doctor's accuracy-fall evidence reads them.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrl.doctor.engines import load_run
from meshrl.doctor.records import RunRecords, load_meshrl

OUTCOMES = ("harmful", "healthy", "ambiguous")
KINDS = ("healthy", "niche_lost", "lr_blowup", "broken_verifier", "constant_reward", "broken_grouping",
         "bf16_mismatch", "truncation", "reward_hacking")
SPLITS = ("tune", "report")
LABEL_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,), "source": (str,), "engine": (str,), "outcome": (str,), "kind": (str,),
    "fault_step": (int, type(None)), "harm_step": (int, type(None)), "steps": (int,), "split": (str,),
    "note": (str,),
}


@dataclass
class CorpusRun:
    """One labelled run: its label (``label.json`` fields) and its records in meshrl's names."""

    label: dict[str, Any]
    records: RunRecords

    @property
    def id(self) -> str:
        return str(self.label["id"])


def check_label(label: Any, where: str) -> dict[str, Any]:
    """``label`` validated against the corpus schema; ``ValueError`` naming ``where`` and the field."""
    if not isinstance(label, dict):
        raise ValueError(f"{where}: a label must be a JSON object, got {type(label).__name__}")
    for name, types in LABEL_FIELDS.items():
        if name not in label:
            raise ValueError(f"{where}: label field {name!r} is missing")
        value = label[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"{where}: label field {name!r}={value!r} is not {' or '.join(t.__name__ for t in types)}")
    for name, allowed in (("outcome", OUTCOMES), ("kind", KINDS), ("split", SPLITS), ("engine", ("meshrl", "trl"))):
        if label[name] not in allowed:
            raise ValueError(f"{where}: label field {name!r}={label[name]!r}; known: {', '.join(allowed)}")
    return dict(label)


def load_corpus(root: Path) -> list[CorpusRun]:
    """Every directory under ``root`` (itself included) holding a ``label.json``, sorted by label id; duplicate
    ids are an error."""
    runs = []
    for label_path in sorted(root.rglob("label.json")):
        label = check_label(json.loads(label_path.read_text()), str(label_path))
        records = load_run(label_path.parent, label["engine"])
        runs.append(CorpusRun(label, records))
    return _unique(runs)


def _unique(runs: list[CorpusRun]) -> list[CorpusRun]:
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.id] = seen.get(run.id, 0) + 1
    dupes = sorted(k for k, n in seen.items() if n > 1)
    if dupes:
        raise ValueError(f"duplicate corpus run id(s): {', '.join(dupes)}")
    return sorted(runs, key=lambda r: r.id)


def checkpoint_evals(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(step, eval.json)`` of every checkpoint evaluation of a testbed run, by step."""
    out = []
    for path in run_dir.glob("ckpt_eval/step_*/eval.json"):
        step_text = path.parent.name.removeprefix("step_")
        if not step_text.isdigit():
            raise ValueError(f"{path}: checkpoint directory name is not step_<int>")
        out.append((int(step_text), json.loads(path.read_text())))
    return sorted(out, key=lambda p: p[0])


def niche_accuracy(ev: dict[str, Any], niche: str, where: str) -> float:
    """pass@1 (c/n) of the ``niche`` type in an ``eval.json``; ``ValueError`` naming ``where`` when absent."""
    group = ev.get("by", {}).get("groups", {}).get(niche)
    if not isinstance(group, dict) or not isinstance(group.get("pass@1"), int | float):
        raise ValueError(f"{where}: no pass@1 for the {niche!r} type (by.groups.{niche}.pass@1)")
    return float(group["pass@1"])


def label_testbed_run(run_dir: Path, *, source: str, arm: str, seed: int, niche: str, fall_at: float,
                  kept_at: float) -> dict[str, Any] | None:
    """The label of one testbed run (module docstring), or ``None`` when it has no checkpoint evaluation."""
    series = [(s, niche_accuracy(ev, niche, f"{run_dir}/ckpt_eval/step_{s}/eval.json"))
              for s, ev in checkpoint_evals(run_dir)]
    if not series:
        return None
    harm_step = next((s for s, acc in series if acc < fall_at), None)
    final_path = run_dir / "eval" / "eval.json"
    final = (niche_accuracy(json.loads(final_path.read_text()), niche, str(final_path)) if final_path.is_file()
             else series[-1][1])
    outcome = "harmful" if harm_step is not None else "healthy" if final >= kept_at else "ambiguous"
    return {"id": f"{source}/{arm}/s{seed}", "source": source, "engine": "meshrl", "outcome": outcome,
            "kind": "healthy" if outcome == "healthy" else "niche_lost", "fault_step": None,
            "harm_step": harm_step, "steps": 0, "split": "tune" if seed % 2 == 0 else "report",
            "note": f"collapse testbed arm {arm}, seed {seed}: {niche} held-out accuracy by checkpoint "
                    + ", ".join(f"{s}:{a:.3f}" for s, a in series) + f"; final {final:.3f}",
            # beyond the shared schema: a harmful run whose niche came back (kept at the end)
            "recovered": outcome == "harmful" and final >= kept_at}


def eval_record(step: int, ev: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint evaluation as the held-out record a run with ``eval.every`` logs: ``eval/<overall key>`` and
    ``eval/type/<type>`` (pass@1 of each type)."""
    row: dict[str, Any] = {"step": step}
    row.update({f"eval/{k}": float(v) for k, v in ev.get("overall", {}).items() if k != "problems"})
    row.update({f"eval/type/{t}": float(g["pass@1"]) for t, g in ev.get("by", {}).get("groups", {}).items()})
    return row


def _testbed_settings(exp_dir: Path) -> tuple[str, Any, float]:
    import meshrl.testbed  # noqa: F401  (registers the testbed tasks)
    from meshrl.tasks import load_task

    path = exp_dir / "settings.json"
    settings = json.loads(path.read_text()) if path.is_file() else {}
    name = str(settings.get("task", "testbed:add"))
    return name, load_task(name), float(settings.get("niche_kept_at", 0.5))


def testbed_runs(exp_dir: Path, name: str, *, attach_evals: bool = True) -> list[CorpusRun]:
    """The finished runs (``done.json`` and at least one checkpoint evaluation) of a testbed experiment
    directory, labelled (module docstring), with source ``<task>/<name>`` (``testbed:add/round2``). Runs still
    training are left out."""
    from experiments.collapse_testbed.results import NICHE_FALL_AT

    task_name, task, kept_at = _testbed_settings(exp_dir)
    source = f"{task_name}/{name}"
    out = []
    for run_dir in sorted(exp_dir.glob("runs/*/seed_*")):
        seed_text = run_dir.name.removeprefix("seed_")
        if not seed_text.isdigit() or not (run_dir / "done.json").is_file():
            continue
        label = label_testbed_run(run_dir, source=source, arm=run_dir.parent.name, seed=int(seed_text),
                              niche=task.headline_niche, fall_at=NICHE_FALL_AT, kept_at=kept_at)
        if label is None:
            continue
        records = dataclasses.replace(load_meshrl(run_dir), samples=[])  # the packs keep no training samples
        if attach_evals and not records.evals:
            records.evals = [eval_record(s, ev) for s, ev in checkpoint_evals(run_dir)]
        label["steps"] = len(records.steps)
        out.append(CorpusRun(check_label(label, str(run_dir)), records))
    return out


def testbed_pack_runs(pack: Path, name: str, *, attach_evals: bool = True) -> list[CorpusRun]:
    """:func:`testbed_runs` of a testbed pack (``experiments.collapse_testbed.pack``), unpacked to a temporary
    directory (the records are in memory when it is removed)."""
    from experiments.collapse_testbed.pack import unpack_experiment

    with tempfile.TemporaryDirectory(prefix="health_corpus_") as tmp:
        unpack_experiment(pack, Path(tmp))
        runs = testbed_runs(Path(tmp), name, attach_evals=attach_evals)
    for run in runs:  # the temporary path is gone: name the pack instead
        run.records.path = pack / run.id
    return runs


def recovered_as_ambiguous(runs: list[CorpusRun]) -> list[CorpusRun]:
    """The runs with every harmful run that ``recovered`` relabelled ``ambiguous`` (the stricter reading of
    harm: the niche was lost, not only dipped)."""
    out = []
    for run in runs:
        if run.label.get("recovered"):
            run = CorpusRun({**run.label, "outcome": "ambiguous", "note": run.label["note"] + "; recovered: "
                             "relabelled ambiguous"}, run.records)
        out.append(run)
    return out


def experiment_name(path: Path) -> str:
    """``round2`` for a pack ``testbed_round2.json.gz`` or an experiment directory ``round2``."""
    return path.name.removesuffix(".json.gz").removeprefix("testbed_")
